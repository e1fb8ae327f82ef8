"""Writes a token file: a repeated pattern of ids (nanoGPT layout: flat uint16 or uint32)."""
import struct
import sys

path, count, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "uint16"
start = int(sys.argv[4]) if len(sys.argv) > 4 else 1
pattern = list(range(start, start + 16))
ids = [pattern[i % len(pattern)] for i in range(count)]
with open(path, "wb") as f:
    f.write(struct.pack("<%d%s" % (len(ids), "H" if dtype == "uint16" else "I"), *ids))
