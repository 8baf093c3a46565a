"""The MAC's rate per thread count: AES-GMAC (`cryptography`) against keyed BLAKE3 (`blake3`), 2 MiB values.

Each MAC runs on 1, 2, 4 and 8 threads of this process (a `ThreadPoolExecutor`, as the Mooncake client's MAC threads
are), median of 5 passes over 64 values: a rate that does not grow with threads means the MAC holds the GIL.

Usage: `python tools/probes/mac_rates.py` (needs `cryptography` and `blake3`).
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from blake3 import blake3
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY = os.urandom(32)
VALUES = [np.random.default_rng(i).integers(0, 256, 2 << 20, dtype=np.uint8) for i in range(64)]
MACS = {"AES-GMAC": lambda value: AESGCM(KEY).encrypt(os.urandom(12), b"header", memoryview(value)),
        "keyed BLAKE3": lambda value: blake3(memoryview(value), key=KEY).digest()}

if __name__ == "__main__":
    for name, mac in MACS.items():
        for threads in (1, 2, 4, 8):
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(mac, VALUES[:8]))  # the threads started
                passes = []
                for _ in range(5):
                    start = time.perf_counter()
                    list(pool.map(mac, VALUES))
                    passes.append(time.perf_counter() - start)
            rate = len(VALUES) * VALUES[0].nbytes / statistics.median(passes) / 1e9
            print(f"{name:13s} {threads} threads: {rate:5.1f} GB/s")
