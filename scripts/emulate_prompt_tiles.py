# Emulates paged_attention_prefill_bf16's fragment math (attention.cu) for one warp (one query
# head) of one tile, by the PTX layouts of ldmatrix (.x4, .trans) and mma.m16n8k16, in f64 without
# bf16 rounding, against plain causal attention: a check of the kernel's indexing that needs no
# GPU (`python3 scripts/emulate_prompt_tiles.py`; it mirrors the kernel's code, so change both).
import math, random
random.seed(1)
HEAD_DIM = 64
PF_KEYS = 32
KS, NT, KT = HEAD_DIM // 16, HEAD_DIM // 8, PF_KEYS // 8

def ldmatrix_x4(addr_of_lane, smem, trans=False):
    # addr_of_lane(l) -> (row, col) start of the 8-element row lane l supplies.
    out = [[None]*4 for _ in range(32)]
    for i in range(4):
        rows = [addr_of_lane(8*i + r) for r in range(8)]
        M = [[smem[rr][cc + j] for j in range(8)] for (rr, cc) in rows]
        for l in range(32):
            g, c = l >> 2, l & 3
            if trans:
                out[l][i] = (M[2*c][g], M[2*c+1][g])
            else:
                out[l][i] = (M[g][2*c], M[g][2*c+1])
    return out

def mma(d, a, b):
    # d[l] = [4 floats], a[l] = 4 pairs, b[l] = 2 pairs
    A = [[0]*16 for _ in range(16)]; B = [[0]*8 for _ in range(16)]
    for l in range(32):
        g, c = l >> 2, l & 3
        A[g][2*c], A[g][2*c+1] = a[l][0]
        A[g+8][2*c], A[g+8][2*c+1] = a[l][1]
        A[g][2*c+8], A[g][2*c+9] = a[l][2]
        A[g+8][2*c+8], A[g+8][2*c+9] = a[l][3]
        B[2*c][g], B[2*c+1][g] = b[l][0]
        B[2*c+8][g], B[2*c+9][g] = b[l][1]
    for l in range(32):
        g, c = l >> 2, l & 3
        for i in range(4):
            r = g + (8 if i >= 2 else 0); n = 2*c + (i & 1)
            d[l][i] += sum(A[r][k] * B[k][n] for k in range(16))

def run(count, positions, Q, K, V, scale):
    ctx = positions[count-1] + 1
    slices = (ctx + PF_KEYS - 1) // PF_KEYS
    qa = [[None]*4 for _ in range(KS)]
    QA = [[[None]*4 for _ in range(KS)] for _ in range(32)]
    for l in range(32):
        g, c = l >> 2, l & 3
        t0, t1 = min(g, count-1), min(g+8, count-1)
        for s in range(KS):
            QA[l][s][0] = (Q[t0][16*s+2*c], Q[t0][16*s+2*c+1])
            QA[l][s][1] = (Q[t1][16*s+2*c], Q[t1][16*s+2*c+1])
            QA[l][s][2] = (Q[t0][16*s+2*c+8], Q[t0][16*s+2*c+9])
            QA[l][s][3] = (Q[t1][16*s+2*c+8], Q[t1][16*s+2*c+9])
    o = [[[0.0]*4 for _ in range(NT)] for _ in range(32)]
    m0 = [-math.inf]*32; m1 = [-math.inf]*32; l0 = [0.0]*32; l1 = [0.0]*32
    for sl in range(slices):
        j0 = sl * PF_KEYS
        sk = [K[min(j0+key, ctx-1)] for key in range(PF_KEYS)]
        sv = [V[min(j0+key, ctx-1)] for key in range(PF_KEYS)]
        sc = [[[0.0]*4 for _ in range(KT)] for _ in range(32)]
        for s in range(KS):
            for np_ in range(KT//2):
                b = ldmatrix_x4(lambda l: (16*np_ + ((l>>3)>>1)*8 + (l&7), 16*s + ((l>>3)&1)*8), sk)
                mma([sc[l][2*np_] for l in range(32)], [QA[l][s] for l in range(32)], [(b[l][0], b[l][1]) for l in range(32)])
                mma([sc[l][2*np_+1] for l in range(32)], [QA[l][s] for l in range(32)], [(b[l][2], b[l][3]) for l in range(32)])
        mx0 = [0]*32; mx1 = [0]*32
        for l in range(32):
            g, c = l >> 2, l & 3
            pos0 = positions[min(g, count-1)]; pos1 = positions[min(g+8, count-1)]
            a0, a1 = m0[l], m1[l]
            for n in range(KT):
                for e in range(2):
                    j = j0 + 8*n + 2*c + e
                    sc[l][n][e] = sc[l][n][e]*scale if j <= pos0 else -math.inf
                    sc[l][n][2+e] = sc[l][n][2+e]*scale if j <= pos1 else -math.inf
                    a0 = max(a0, sc[l][n][e]); a1 = max(a1, sc[l][n][2+e])
            mx0[l], mx1[l] = a0, a1
        for l in range(32):  # quad reduce
            q = [x for x in range(32) if x >> 2 == l >> 2]
            M0 = max(mx0[x] for x in q); M1 = max(mx1[x] for x in q)
            c0 = 2**(m0[l]-M0) if m0[l] != -math.inf else 0.0
            c1 = 2**(m1[l]-M1) if m1[l] != -math.inf else 0.0
            m0[l], m1[l] = M0, M1
            l0[l] *= c0; l1[l] *= c1
            for n in range(NT):
                o[l][n][0] *= c0; o[l][n][1] *= c0; o[l][n][2] *= c1; o[l][n][3] *= c1
        for np_ in range(KT//2):
            A = []
            for l in range(32):
                p = [[2**(sc[l][2*np_+h][i] - (m0[l] if i < 2 else m1[l])) if sc[l][2*np_+h][i] != -math.inf else 0.0 for i in range(4)] for h in range(2)]
                l0[l] += p[0][0]+p[0][1]+p[1][0]+p[1][1]; l1[l] += p[0][2]+p[0][3]+p[1][2]+p[1][3]
                A.append([(p[0][0], p[0][1]), (p[0][2], p[0][3]), (p[1][0], p[1][1]), (p[1][2], p[1][3])])
            for dp in range(NT//2):
                b = ldmatrix_x4(lambda l: (16*np_ + ((l>>3)&1)*8 + (l&7), 16*dp + ((l>>3)>>1)*8), sv, trans=True)
                mma([o[l][2*dp] for l in range(32)], A, [(b[l][0], b[l][1]) for l in range(32)])
                mma([o[l][2*dp+1] for l in range(32)], A, [(b[l][2], b[l][3]) for l in range(32)])
    L0 = [sum(l0[x] for x in range(32) if x >> 2 == l >> 2) for l in range(32)]
    L1 = [sum(l1[x] for x in range(32) if x >> 2 == l >> 2) for l in range(32)]
    out = {}
    for l in range(32):
        g, c = l >> 2, l & 3
        for n in range(NT):
            d = 8*n + 2*c
            if g < count:
                out[(g, d)] = o[l][n][0]/L0[l]; out[(g, d+1)] = o[l][n][1]/L0[l]
            if g + 8 < count:
                out[(g+8, d)] = o[l][n][2]/L1[l]; out[(g+8, d+1)] = o[l][n][3]/L1[l]
    return out

def reference(count, positions, Q, K, V, scale):
    out = {}
    for t in range(count):
        s = [sum(Q[t][d]*K[j][d] for d in range(HEAD_DIM))*scale for j in range(positions[t]+1)]
        m = max(s); w = [2**(x-m) for x in s]; z = sum(w)
        for d in range(HEAD_DIM):
            out[(t, d)] = sum(w[j]*V[j][d] for j in range(len(w)))/z
    return out

for count, first in [(16, 0), (5, 40), (1, 70), (11, 3)]:
    positions = list(range(first, first+count))
    ctx = positions[-1]+1
    Q = [[random.uniform(-1,1) for _ in range(HEAD_DIM)] for _ in range(count)]
    K = [[random.uniform(-1,1) for _ in range(HEAD_DIM)] for _ in range(ctx)]
    V = [[random.uniform(-1,1) for _ in range(HEAD_DIM)] for _ in range(ctx)]
    got = run(count, positions, Q, K, V, 0.3)
    want = reference(count, positions, Q, K, V, 0.3)
    err = max(abs(got[k]-want[k]) for k in want)
    assert set(got) == set(want), "coverage"
    assert err < 1e-12, f"count {count} first {first}: off by {err}"
    print(f"count {count} first {first}: max error {err:.2e}")
