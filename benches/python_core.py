"""Python-side costs of the core, against msgspec doing the same work.

    python benches/python_core.py [--events 4096] [--ranks 8] [--repeat 15]

Measures, in one run and interleaved (the machine is shared and noisy):
- encode: `kvmerge.encode` vs msgspec encoding the same events plus a
  per-event identity computed in Python (BLAKE2b-128 of each event's msgpack);
- output objects: `Merger.finish_step()` (merge + objects) vs
  `msgspec.msgpack.decode` of the same events;
- raw output: `Merger.finish_step_raw()` vs the same msgspec decode;
- merge alone: `Merger.finish_step_batch()`.
Prints the best time of each and the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections.abc import Callable

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored

import kvmerge


def make_events(n: int, seed: int = 0) -> list[BlockStored | BlockRemoved]:
    """~8 hashes and 128 token ids per store, ~15% removals."""
    rng = random.Random(seed)
    out: list[BlockStored | BlockRemoved] = []
    for i in range(n):
        hashes = [rng.getrandbits(63) for _ in range(8)]
        if i % 7 == 6:
            out.append(BlockRemoved(block_hashes=hashes, medium="CPU"))
        else:
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=rng.getrandbits(63),
                    token_ids=[rng.randrange(150_000) for _ in range(128)],
                    block_size=16,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=0,
                )
            )
    return out


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    events = make_events(args.events)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(list[BlockStored | BlockRemoved])
    payload = encoder.encode(events)
    batch = kvmerge.encode(events)
    merger = kvmerge.Merger(args.ranks)

    def msgspec_encode_and_identities() -> None:
        encoder.encode(events)
        for e in events:
            hashlib.blake2b(encoder.encode(e), digest_size=16).digest()

    def merged(finish: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            for r in range(args.ranks):
                merger.add(r, batch)
            return finish()

        return run

    cases = {
        "kvmerge.encode": lambda: kvmerge.encode(events),
        "msgspec encode + identities": msgspec_encode_and_identities,
        "msgspec encode alone": lambda: encoder.encode(events),
        "msgspec decode": lambda: decoder.decode(payload),
        "merge -> batch": merged(merger.finish_step_batch),
        "merge -> objects": merged(merger.finish_step),
        "merge -> msgspec.Raw": merged(merger.finish_step_raw),
    }
    results = {name: float("inf") for name in cases}
    for _ in range(args.repeat):  # interleave the cases: noise hits all alike
        for name, fn in cases.items():
            results[name] = min(results[name], best(fn, 1))

    n = args.events
    print(f"{args.ranks} ranks x {n} events, {batch.nbytes / 1e6:.2f} MB per batch")
    for name, t in results.items():
        print(f"  {name:<30} {t * 1e3:8.3f} ms  ({t / n * 1e9:7.1f} ns/event)")
    r = results
    print("ratios (target):")
    enc = r["kvmerge.encode"] / r["msgspec encode + identities"]
    print(f"  encode / (msgspec encode + identities) = {enc:.2f}  (<= 1)")
    objs = r["merge -> objects"] / r["msgspec decode"]
    print(f"  merge->objects / msgspec decode        = {objs:.2f}  (<= 1)")
    raw = r["merge -> msgspec.Raw"] / r["msgspec decode"]
    print(f"  merge->Raw / msgspec decode            = {raw:.2f}  (small)")


if __name__ == "__main__":
    main()
