"""GPU check for the engine extension (run by gpu_check.sh on an H200; `--device cpu` is a smoke run).

Prints:
- layer-wait kernel: launch cost when the flag is already set (what every layer of a fetching batch
  pays), and release latency after another stream publishes the flag;
- monitor fallback: a fetch that never completes releases the waiting kernel within the timeout;
- page copy: a 25K-token unit's KV pages copied between two KV pools page by page (the write decode does
  into prefill's pages), its bandwidth, and the same copy overlapped with per-layer waits, where each
  layer group's flag is written on the copy stream right after its pages.
Checks byte equality of every copied page. Sizes are modest so the whole run takes well under 5 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from basin_engine_ext.layer_wait import READY, FetchMonitor, LayerGroupFlags


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def stream_ctx(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def check_wait_kernel(device: torch.device, layers: int, repeats: int) -> None:
    flags = LayerGroupFlags(layers, 1, device)
    for g in range(layers):
        flags.mark(g, READY)
    for layer in range(layers):  # compile and warm up
        flags.wait_layer(layer)
    t0 = now(device)
    for _ in range(repeats):
        for layer in range(layers):
            flags.wait_layer(layer)
    per = (now(device) - t0) / (repeats * layers)
    print(f"wait kernel, flag already set: {per * 1e6:.2f} us per layer ({repeats * layers} launches)")

    if device.type != "cuda":
        return
    delays = []
    for _ in range(repeats // 10 or 1):
        f = LayerGroupFlags(1, 1, device)
        f.wait_layer(0, max_spins=50_000_000)  # spins on the compute stream
        time.sleep(0.002)
        t_mark = time.perf_counter()
        f.mark(0, READY)  # published on the flags' side stream
        torch.cuda.synchronize(device)
        delays.append(time.perf_counter() - t_mark)
        assert not f.layer_failed(0)
    delays.sort()
    print(
        f"wait kernel release after the flag is published: median {delays[len(delays) // 2] * 1e6:.1f} us, "
        f"max {delays[-1] * 1e6:.1f} us (includes one host synchronize)"
    )


def check_fallback(device: torch.device) -> None:
    flags = LayerGroupFlags(4, 2, device)
    timeout = 0.05
    t0 = time.perf_counter()
    monitor = FetchMonitor(flags, timeout, poll_ready=lambda: []).start()
    flags.wait_layer(0, max_spins=200_000_000)
    failed = flags.layer_failed(0)  # reading status synchronises the stream
    waited = time.perf_counter() - t0
    outcome = monitor.join(5)
    assert failed and outcome.reason == "timeout", outcome
    print(
        f"fallback: a stalled fetch released the waiting kernel after {waited * 1e3:.1f} ms "
        f"(timeout {timeout * 1e3:.0f} ms)"
    )


def make_pool(pages: int, page: int, layers: int, heads: int, dim: int, device, dtype, fill: bool):
    k = torch.empty(layers, pages, page, heads, dim, dtype=dtype, device=device)
    v = torch.empty_like(k)
    if fill:
        k.normal_()
        v.normal_()
    else:
        k.zero_()
        v.zero_()
    return k, v


def check_page_copy(
    device: torch.device, tokens: int, page: int, layers: int, heads: int, dim: int, per_group: int
) -> None:
    dtype = torch.bfloat16
    n_pages = tokens // page
    pool_pages = n_pages * 2
    src_k, src_v = make_pool(pool_pages, page, layers, heads, dim, device, dtype, fill=True)
    dst_k, dst_v = make_pool(pool_pages, page, layers, heads, dim, device, dtype, fill=False)
    gen = torch.Generator(device="cpu").manual_seed(0)
    src_pages = torch.randperm(pool_pages, generator=gen)[:n_pages].to(device)
    dst_pages = torch.randperm(pool_pages, generator=gen)[:n_pages].to(device)
    unit_bytes = 2 * layers * n_pages * page * heads * dim * dtype.itemsize
    groups = [range(s, min(s + per_group, layers)) for s in range(0, layers, per_group)]

    def copy_group(g: int) -> None:
        for layer in groups[g]:
            dst_k[layer].index_copy_(0, dst_pages, src_k[layer].index_select(0, src_pages))
            dst_v[layer].index_copy_(0, dst_pages, src_v[layer].index_select(0, src_pages))

    for g in range(len(groups)):  # warm-up
        copy_group(g)
    t0 = now(device)
    for g in range(len(groups)):
        copy_group(g)
    copy_s = now(device) - t0
    print(
        f"page copy: {tokens} tokens, {layers} layers, {unit_bytes / 2**30:.2f} GiB in {copy_s * 1e3:.2f} ms "
        f"= {unit_bytes / copy_s / 1e9:.1f} GB/s (bytes of the unit, read once and written once)"
    )
    assert torch.equal(dst_k[:, dst_pages], src_k[:, src_pages]) and torch.equal(
        dst_v[:, dst_pages], src_v[:, src_pages]
    )
    print("page copy: destination pages byte-equal to the source")

    # Overlap: the copy stream writes group g then its flag; the compute stream waits per layer.
    dst_k.zero_()
    dst_v.zero_()
    flags = LayerGroupFlags(layers, per_group, device)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    layer_sums = []
    t0 = now(device)
    if copy_stream is not None:
        copy_stream.wait_stream(torch.cuda.current_stream(device))
        for layer in range(layers):  # enqueue the waits and the per-layer work first
            flags.wait_layer(layer, max_spins=200_000_000)
            layer_sums.append(dst_k[layer, dst_pages].float().sum())
        with stream_ctx(copy_stream):
            for g in range(len(groups)):
                copy_group(g)
                flags.flags[g : g + 1].fill_(READY)
    else:  # CPU: the interpreter blocks in the kernel, so publish first
        for g in range(len(groups)):
            copy_group(g)
            flags.flags[g] = READY
        for layer in range(layers):
            flags.wait_layer(layer)
            layer_sums.append(dst_k[layer, dst_pages].float().sum())
    overlapped_s = now(device) - t0
    assert all(not flags.layer_failed(layer) for layer in range(layers))
    expected = [src_k[layer, src_pages].float().sum() for layer in range(layers)]
    assert all(torch.equal(a, b) for a, b in zip(layer_sums, expected, strict=True)), (
        "a layer read before its pages"
    )
    print(
        f"overlapped fetch ({len(groups)} groups of {per_group} layers): "
        f"{overlapped_s * 1e3:.2f} ms end to end; "
        "every layer read its pages only after its flag"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=25_600)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers-per-group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    import triton

    print(f"triton {triton.__version__}")
    check_wait_kernel(device, args.layers, args.repeats)
    check_fallback(device)
    check_page_copy(device, args.tokens, args.page, args.layers, args.heads, args.dim, args.layers_per_group)
    print("gpu check: all passed")


if __name__ == "__main__":
    main()
