#!/usr/bin/env python3
"""Generate the (de)quantization fixtures in crates/strata-formats/tests/fixtures/quant.

For each GGML type that strata dequantizes, writes `<TYPE>.bin` (raw block bytes) and
`<TYPE>.f32` (the values `gguf.quants.dequantize` decodes from them, little-endian f32).
Quantized blocks are random bytes whose f16 scale/min fields are overwritten by finite
f16 values, so the expected outputs are finite. Float types are raw random bit patterns
plus a list of special values (zeros, subnormals, infinities, quiet and signaling NaNs).

For each type that `gguf.quants.quantize` implements and strata quantizes (F16, BF16 and
the 32-value types; the reference has no K-quant quantizer), writes `quantize_<TYPE>.bin`:
the bytes it makes of the values in `quantize_input.f32` (random blocks of widely varying
scale, plus all-zero, constant, tied-extreme and single-outlier blocks).

The reference package has no K-quant quantizer, so `quantize_Q4_K.bin`, `quantize_Q5_K.bin`
and `quantize_Q6_K.bin` come from ggml's own reference quantizers (`quantize_row_q*_K_ref`)
run on `quantize_k_input.f32`: a small C driver linked against the `libggml-base.a` that
`make bench-peers` builds from the pinned llama.cpp source into $STRATA_CACHE/llama.cpp
(needs gcc; the script says so when that library is missing).

Pinned reference: gguf==0.19.0, numpy==2.4.6 (the script refuses other versions).
Rerunning it reproduces the committed files byte for byte; `--check` compares instead
of writing and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

GGUF_VERSION = "0.19.0"
NUMPY_VERSION = "2.4.6"
SEED = 0x5742A7A

OUT_DIR = Path(__file__).resolve().parent.parent / "crates" / "strata-formats" / "tests" / "fixtures" / "quant"

T = GGMLQuantizationType

# Byte offsets of the f16 scale/min fields inside one block of each quantized type.
F16_FIELD_OFFSETS: dict[GGMLQuantizationType, list[int]] = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

# Blocks per quantized fixture: 64 for 32-value blocks, 16 for 256-value super-blocks.
BLOCKS_BY_BLOCK_LEN = {32: 64, 256: 16}

# Random values per float fixture (special values are appended).
FLOAT_VALUES = 2048

F16_SPECIALS = [
    0x0000, 0x8000,  # +-0
    0x0001, 0x8001, 0x03FF, 0x83FF, 0x0200,  # subnormals
    0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,  # normals: min, +-1, +-max
    0x7C00, 0xFC00,  # +-inf
    0x7E00, 0xFE00, 0x7FFF,  # quiet NaNs
    0x7C01, 0xFC01, 0x7D55,  # signaling NaNs
]
BF16_SPECIALS = [
    0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x3F80, 0xBF80, 0x7F7F,
    0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FFF, 0x7F81, 0xFF81, 0x7FA5,
]
F32_SPECIALS = [
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF,
    0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFA5A5A5,
]


def sane_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 scales: mostly small normals of both signs, with some zeros,
    subnormals and large values mixed in."""
    values = (rng.standard_normal(n) * 0.02).astype(np.float16)
    kind = rng.integers(0, 16, size=n)
    values[kind == 0] = np.float16(0.0)
    subnormal_bits = rng.integers(1, 0x400, size=n, dtype=np.uint16)
    values[kind == 1] = subnormal_bits[kind == 1].view(np.float16)
    values[kind == 2] = (rng.standard_normal(n) * 500).astype(np.float16)[kind == 2]
    assert np.all(np.isfinite(values))
    return values


def quant_fixture(qtype: GGMLQuantizationType, rng: np.random.Generator) -> tuple[bytes, bytes]:
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = BLOCKS_BY_BLOCK_LEN[block_len]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELD_OFFSETS[qtype]:
        blocks[:, offset : offset + 2] = sane_f16(rng, n_blocks).reshape(n_blocks, 1).view(np.uint8)
    raw = blocks.reshape(-1)
    values = np.asarray(dequantize(raw, qtype), dtype=np.float32)
    assert values.shape == (n_blocks * block_len,), values.shape
    assert np.all(np.isfinite(values)), qtype.name
    return raw.tobytes(), values.astype("<f4").tobytes()


def float_fixture(qtype: GGMLQuantizationType, rng: np.random.Generator) -> tuple[bytes, bytes]:
    if qtype == T.F32:
        bits = np.concatenate([rng.integers(0, 2**32, size=FLOAT_VALUES, dtype=np.uint32),
                               np.array(F32_SPECIALS, dtype=np.uint32)]).astype("<u4")
    else:
        specials = F16_SPECIALS if qtype == T.F16 else BF16_SPECIALS
        bits = np.concatenate([rng.integers(0, 2**16, size=FLOAT_VALUES, dtype=np.uint16),
                               np.array(specials, dtype=np.uint16)]).astype("<u2")
    raw = bits.view(np.uint8)
    values = np.asarray(dequantize(raw, qtype), dtype=np.float32)
    assert values.shape == (bits.size,), values.shape
    return raw.tobytes(), values.astype("<f4").tobytes()


FIXTURE_TYPES = [T.F32, T.F16, T.BF16, *F16_FIELD_OFFSETS]

# Types whose quantizer bytes are compared with the reference's.
QUANTIZE_TYPES = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
QUANTIZE_BLOCKS = 64


def quantize_input() -> np.ndarray:
    """64 blocks of 32 values: random normals scaled by 2^-12 .. 2^6 per block, then a few
    blocks of shapes that exercise the rounding rules (zeros, constants, ties, one outlier)."""
    rng = np.random.default_rng([SEED, 0x9A])
    scales = np.exp2(rng.uniform(-12, 6, size=(QUANTIZE_BLOCKS, 1)))
    values = (rng.standard_normal((QUANTIZE_BLOCKS, 32)) * scales).astype(np.float32)
    values[0] = 0.0
    values[1] = 0.5
    values[2] = -3.0
    values[3, :] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
    values[4, :] = 0.0
    values[4, 7] = -2.5
    values[5, ::2] = 1.25
    values[5, 1::2] = -1.25
    # All positive, all negative: the _1 types' minimum and the _0 types' sign both matter.
    values[6] = np.abs(values[6]) + 0.25
    values[7] = -np.abs(values[7]) - 0.25
    return values.reshape(-1)


# The K-quant types whose bytes come from ggml's reference quantizer, by driver name.
KQUANT_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
KQUANT_BLOCKS = 64

GGML_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
void quantize_row_q4_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q5_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q6_K_ref(const float *x, void *y, int64_t k);
/* usage: driver TYPE IN.f32 OUT.bin */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    FILE *f = fopen(argv[2], "rb");
    if (!f) return 2;
    fseek(f, 0, SEEK_END);
    long n = ftell(f) / 4;
    fseek(f, 0, SEEK_SET);
    float *x = malloc(n * 4);
    if (fread(x, 4, n, f) != (size_t)n) return 2;
    fclose(f);
    void *y = malloc(n);
    size_t bytes;
    if (!strcmp(argv[1], "Q4_K")) { quantize_row_q4_K_ref(x, y, n); bytes = n / 256 * 144; }
    else if (!strcmp(argv[1], "Q5_K")) { quantize_row_q5_K_ref(x, y, n); bytes = n / 256 * 176; }
    else if (!strcmp(argv[1], "Q6_K")) { quantize_row_q6_K_ref(x, y, n); bytes = n / 256 * 210; }
    else return 2;
    FILE *o = fopen(argv[3], "wb");
    fwrite(y, 1, bytes, o);
    fclose(o);
    return 0;
}
"""


def kquant_input() -> np.ndarray:
    """64 super-blocks of 256 values: normals scaled by 2^-20 .. 2^8 per super-block (the
    smallest make f16 scales underflow), then all-zero, half-zero, constant, all-positive,
    all-negative and single-outlier super-blocks."""
    rng = np.random.default_rng([SEED, 0x4B])
    scales = np.exp2(rng.uniform(-20, 8, size=(KQUANT_BLOCKS, 1)))
    values = (rng.standard_normal((KQUANT_BLOCKS, 256)) * scales).astype(np.float32)
    values[0] = 0.0
    values[1, 64:160] = 0.0
    values[2] = 0.75
    values[3] = np.abs(values[3]) + 0.5
    values[4] = -np.abs(values[4]) - 0.5
    values[5] *= np.float32(0.01)
    values[5, 200] = 3.0
    return values.reshape(-1)


def ggml_quantizer() -> Path:
    """Compiles the driver against the cached llama.cpp build; exits with a way out when absent."""
    cache = Path(os.environ.get("STRATA_CACHE") or Path.home() / ".cache" / "strata") / "llama.cpp"
    libs = sorted(cache.glob("build-*/ggml/src/libggml-base.a"))
    include = cache / "src" / "ggml" / "include"
    if not libs or not include.is_dir():
        sys.exit(f"K-quant fixtures need ggml's reference quantizer: {cache}/build-*/ggml/src/libggml-base.a "
                 "is missing; run `make bench-peers` once (it builds llama.cpp into the cache)")
    work = Path(tempfile.mkdtemp(prefix="strata-ggml-quant-"))
    (work / "driver.c").write_text(GGML_DRIVER)
    subprocess.run(["gcc", "-O2", "-I", str(include), str(work / "driver.c"), str(libs[0]), "-fopenmp",
                    "-lm", "-lpthread", "-lstdc++", "-o", str(work / "driver")], check=True)
    return work / "driver"


def ggml_quantize(driver: Path, type_name: str, values: np.ndarray) -> bytes:
    inp, out = driver.parent / "in.f32", driver.parent / f"{type_name}.bin"
    values.astype("<f4").tofile(inp)
    subprocess.run([str(driver), type_name, str(inp), str(out)], check=True)
    return out.read_bytes()


def fixtures() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for qtype in FIXTURE_TYPES:
        # One generator per type, so adding a type never changes the others' fixtures.
        rng = np.random.default_rng([SEED, int(qtype)])
        make = float_fixture if qtype in (T.F32, T.F16, T.BF16) else quant_fixture
        raw, values = make(qtype, rng)
        files[f"{qtype.name}.bin"] = raw
        files[f"{qtype.name}.f32"] = values
    inputs = quantize_input()
    files["quantize_input.f32"] = inputs.astype("<f4").tobytes()
    for qtype in QUANTIZE_TYPES:
        encoded = np.asarray(quantize(inputs, qtype))
        files[f"quantize_{qtype.name}.bin"] = encoded.view(np.uint8).tobytes()
    k_inputs = kquant_input()
    files["quantize_k_input.f32"] = k_inputs.astype("<f4").tobytes()
    driver = ggml_quantizer()
    for type_name in KQUANT_TYPES:
        files[f"quantize_{type_name}.bin"] = ggml_quantize(driver, type_name, k_inputs)
    shutil.rmtree(driver.parent)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the files on disk instead of writing")
    args = parser.parse_args()

    found = {"gguf": version("gguf"), "numpy": np.__version__}
    wanted = {"gguf": GGUF_VERSION, "numpy": NUMPY_VERSION}
    if found != wanted:
        print(f"need {wanted}, found {found}", file=sys.stderr)
        return 2

    files = fixtures()
    if args.check:
        stale = [name for name, data in files.items()
                 if not (OUT_DIR / name).is_file() or (OUT_DIR / name).read_bytes() != data]
        for name in stale:
            print(f"differs: {OUT_DIR / name}", file=sys.stderr)
        return 1 if stale else 0

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (OUT_DIR / name).write_bytes(data)
    total = sum(len(data) for data in files.values())
    print(f"wrote {len(files)} files ({total} bytes) to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
