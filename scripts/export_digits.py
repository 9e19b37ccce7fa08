#!/usr/bin/env python3
"""Exports scikit-learn's bundled digits data set (offline) for examples/digits_trainer.

Writes two files, DIR/digits_train.bin and DIR/digits_test.bin, with a fixed, seeded,
stratified 80/20 split. DIR is --out, else $SHARDPS_DATA_DIR, else build/data.

File format (little-endian), docs/operations.md "Digits data files":
  offset  size        field
  0       4           magic  b"SPDG"
  4       4   uint32  version = 1
  8       4   uint32  n          number of samples
  12      4   uint32  features   = 64 (8x8 pixels)
  16      4   uint32  classes    = 10
  20      4*n*64      float32 features, row-major, pixel / 16 so in [0, 1]
  ...     n   uint8   labels in [0, classes)

Run with Debian's python (/usr/bin/python3, package python3-sklearn).
"""
import argparse
import os
import struct
import sys

MAGIC = b"SPDG"
VERSION = 1


def write(path, x, y, classes):
    import numpy as np

    x = np.ascontiguousarray(x, dtype="<f4")
    y = np.ascontiguousarray(y, dtype=np.uint8)
    n, features = x.shape
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<IIII", VERSION, n, features, classes))
        f.write(x.tobytes())
        f.write(y.tobytes())
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("SHARDPS_DATA_DIR", "build/data"))
    p.add_argument("--seed", type=int, default=20240611)
    p.add_argument("--test_fraction", type=float, default=0.2)
    a = p.parse_args()
    try:
        import numpy as np
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        print(f"export_digits: scikit-learn is not available ({e}); "
              "install python3-sklearn (scripts/deps.sh)", file=sys.stderr)
        return 3
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)  # pixels are 0..16
    y = d.target.astype(np.uint8)
    assert x.shape[1] == 64 and int(y.max()) == 9
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=a.test_fraction,
                                          random_state=a.seed, stratify=y)
    os.makedirs(a.out, exist_ok=True)
    write(os.path.join(a.out, "digits_train.bin"), xtr, ytr, 10)
    write(os.path.join(a.out, "digits_test.bin"), xte, yte, 10)
    print(f"export_digits: {len(ytr)} train + {len(yte)} test samples, 64 features, 10 classes "
          f"-> {a.out}/digits_{{train,test}}.bin (seed {a.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
