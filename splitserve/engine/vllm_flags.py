"""vLLM's command-line options, by name, so that a vLLM command line that asks for something splitserve
does not do fails with one clear line instead of argparse's usage dump.

The table lists vLLM's flags (engine and OpenAI server, as of vLLM 0.10/0.11), supported or not: a flag
counts as unsupported only when the parser at hand does not know it, so a flag that splitserve
implements later (say `--quantization`) stops being reported without touching this table.
Kept free of heavy imports: the CLI consults it before parsing.
"""
from __future__ import annotations

import argparse
from typing import Iterable, Sequence

_ENGINE = """
model task runner convert tokenizer tokenizer-mode trust-remote-code dtype seed hf-config-path
allowed-local-media-path allowed-media-domains revision code-revision rope-scaling rope-theta
tokenizer-revision max-model-len quantization enforce-eager max-seq-len-to-capture max-logprobs
logprobs-mode disable-sliding-window disable-cascade-attn skip-tokenizer-init enable-prompt-embeds
served-model-name disable-async-output-proc config-format hf-token hf-overrides override-neuron-config
override-pooler-config pooler-config logits-processor-pattern generation-config override-generation-config
enable-sleep-mode model-impl override-attention-dtype logits-processors io-processor-plugin load-format
download-dir model-loader-extra-config ignore-patterns use-tqdm-on-load pt-load-map-location
guided-decoding-backend guided-decoding-disable-fallback guided-decoding-disable-any-whitespace
guided-decoding-disable-additional-properties reasoning-parser structured-outputs-config
distributed-executor-backend pipeline-parallel-size tensor-parallel-size data-parallel-size
data-parallel-rank data-parallel-start-rank data-parallel-size-local data-parallel-address
data-parallel-rpc-port data-parallel-backend data-parallel-hybrid-lb data-parallel-external-lb
enable-expert-parallel enable-eplb eplb-config num-redundant-experts eplb-window-size
eplb-step-interval eplb-log-balancedness max-parallel-loading-workers ray-workers-use-nsight
disable-custom-all-reduce worker-cls worker-extension-cls enable-multimodal-encoder-data-parallel
decode-context-parallel-size block-size gpu-memory-utilization kv-cache-memory swap-space kv-cache-dtype
num-gpu-blocks-override enable-prefix-caching prefix-caching-hash-algo cpu-offload-gb
calculate-kv-scales kv-sharing-fast-prefill mamba-cache-dtype mamba-ssm-cache-dtype
limit-mm-per-prompt media-io-kwargs mm-processor-kwargs mm-processor-cache-gb
disable-mm-preprocessor-cache mm-encoder-tp-mode interleave-mm-strings skip-mm-profiling enable-lora
enable-lora-bias max-loras max-lora-rank lora-extra-vocab-size lora-dtype max-cpu-loras
fully-sharded-loras default-mm-loras speculative-config speculative-model num-speculative-tokens
show-hidden-metrics-for-version otlp-traces-endpoint collect-detailed-traces max-num-batched-tokens
max-num-seqs max-num-partial-prefills max-long-partial-prefills long-prefill-token-threshold
num-lookahead-slots scheduler-delay-factor preemption-mode num-scheduler-steps
multi-step-stream-outputs scheduling-policy enable-chunked-prefill disable-chunked-mm-input
scheduler-cls disable-hybrid-kv-cache-manager async-scheduling kv-transfer-config kv-events-config
compilation-config additional-config disable-log-stats enable-log-requests disable-log-requests
device cuda-graph-sizes enable-dbo dbo-decode-token-threshold dbo-prefill-token-threshold
use-v2-block-manager tokenizer-pool-size tokenizer-pool-type tokenizer-pool-extra-config
enable-reasoning enable-prompt-adapter max-prompt-adapters max-prompt-adapter-token
"""

_FRONTEND = """
host port uds uvicorn-log-level disable-uvicorn-access-log allow-credentials allowed-origins
allowed-methods allowed-headers api-key lora-modules prompt-adapters chat-template
chat-template-content-format trust-request-chat-template response-role ssl-keyfile ssl-certfile
ssl-ca-certs enable-ssl-refresh ssl-cert-reqs root-path middleware return-tokens-as-token-ids
disable-frontend-multiprocessing enable-request-id-headers enable-auto-tool-choice
exclude-tools-when-tool-choice-none tool-call-parser tool-parser-plugin tool-server log-config-file
max-log-len disable-fastapi-docs enable-prompt-tokens-details enable-server-load-tracking
enable-force-include-usage enable-tokenizer-info-endpoint enable-log-outputs
h11-max-incomplete-event-size h11-max-header-count log-error-stack headless api-server-count config
"""

# vLLM's short spellings.
_SHORT = ("-tp", "-pp", "-dp", "-dpn", "-dpr", "-dpl", "-dpa", "-dpp", "-dpb", "-q", "-O")

VLLM_FLAGS: frozenset[str] = frozenset(
    ["--" + name for name in (_ENGINE + _FRONTEND).split()] + list(_SHORT))


def message(flag: str) -> str:
    return f"{flag} is a vLLM option splitserve does not support"


def _known_flags(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def leaf_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The (sub)parser that will parse the options of `argv`: `serve`, `bench throughput`, ..."""
    for i, token in enumerate(argv):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            return leaf_parser(subs[0].choices[token], argv[i + 1:])
    return parser


def find_unsupported(parser: argparse.ArgumentParser, argv: Iterable[str]) -> str | None:
    """The first flag in `argv` that vLLM has and this parser lacks (`--flag`, `--flag=value`, or the
    `--no-flag` form of a vLLM switch); None if there is none."""
    argv = list(argv)
    known = _known_flags(leaf_parser(parser, argv))
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        name = token.split("=", 1)[0]
        if name in known:
            continue
        if name in VLLM_FLAGS or (name.startswith("--no-") and "--" + name[5:] in VLLM_FLAGS):
            return name
    return None


def find_unsupported_keywords(keywords: Iterable[str], valid: Iterable[str]) -> list[str]:
    """Keyword arguments (of `LLM(...)`) that name a vLLM option splitserve lacks."""
    valid = set(valid)
    return [k for k in keywords if k not in valid and "--" + k.replace("_", "-") in VLLM_FLAGS]
