#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's source page.

Reads `ncu --import R.ncu-rep --page source --csv --print-source sass` (plain or gzipped) and
prints, for each profiled launch in it, the stall reasons summed over the launch, then the
instructions with the most warp samples and each one's top reasons, then the samples by opcode.
Usage: sass_stalls.py FILE.csv[.gz] [--top N]
"""
import argparse
import collections
import csv
import gzip
import sys


def read_launches(path):
    """Each profiled launch's (kernel name, header, instruction rows): the CSV holds one section a
    launch, a "Kernel Name" row, then a header row, then a row an instruction."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    launches, kernel = [], "?"
    for row in rows:
        if row and row[0] == "Kernel Name":
            kernel = row[1] if len(row) > 1 else "?"
        elif "Address" in row and "Source" in row:
            launches.append((kernel, row, []))
        elif launches and len(row) == len(launches[-1][1]):
            launches[-1][2].append(row)
    if not launches:
        sys.exit(f"{path}: no header row with Address and Source (not ncu's source page as CSV?)")
    return launches


def number(cell):
    try:
        return int(cell)
    except ValueError:
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for kernel, header, data in read_launches(args.csv):
        summarize(kernel, header, data, args.top)


def summarize(kernel, header, data, top_n):
    samples_col = header.index("Warp Stall Sampling (All Samples)")
    source_col = header.index("Source")
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    cols = {h: header.index(h) for h in reasons}
    total = sum(number(r[samples_col]) for r in data)
    if total == 0:
        print(f"{kernel}: no warp samples")
        return
    print(f"\n== {kernel}: {total} warp samples over {len(data)} instructions")
    by_reason = collections.Counter()
    for r in data:
        for h in reasons:
            by_reason[h] += number(r[cols[h]])
    print("\nstall reasons, share of all samples:")
    for h, n in by_reason.most_common():
        if n:
            print(f"  {h[6:]:<20} {100 * n / total:5.1f} %")
    print(f"\nthe {top_n} instructions with the most samples:")
    for r in sorted(data, key=lambda r: -number(r[samples_col]))[:top_n]:
        top = sorted(((number(r[cols[h]]), h[6:]) for h in reasons), reverse=True)[:3]
        why = ", ".join(f"{h} {n}" for n, h in top if n)
        print(f"  {number(r[samples_col]):>6}  {r[source_col].strip()[:56]:<56}  {why}")
    by_op = collections.Counter()
    for r in data:
        words = r[source_col].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        by_op[op.split(".")[0]] += number(r[samples_col])
    print("\nsamples by opcode:")
    for op, n in by_op.most_common(15):
        print(f"  {op:<12} {100 * n / total:5.1f} %")


if __name__ == "__main__":
    main()
