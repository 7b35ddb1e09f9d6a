"""One deployment's settings in the words of each serving engine, and the
``vllm bench serve`` command that checks a recommendation against a server.

The cube's deployment axes map onto each engine's own arguments (vLLM;
SGLang; TensorRT-LLM):

* tensor_parallel: ``--tensor-parallel-size``; ``--tp-size``; ``--tp_size``
* concurrency: ``--max-num-seqs``; ``--max-running-requests``; ``--max_batch_size``
* token_budget: ``--max-num-batched-tokens``; ``--chunked-prefill-size``;
  ``--max_num_tokens``
* gpu_memory_utilization: ``--gpu-memory-utilization``;
  ``--mem-fraction-static``; ``--kv_cache_free_gpu_memory_fraction``
* weight_dtype, where it is not bf16: ``--quantization fp8`` (W8A8, the
  weights quantised as they load); ``--quantization fp8``, and
  ``--torchao-config int4wo-128`` for int4 (weight-only, one scale per 128
  weights, as the model counts them); none (TensorRT-LLM's PyTorch backend
  takes the quantisation from the checkpoint)
* kv_dtype ``fp8``: ``--kv-cache-dtype fp8`` (E4M3); ``--kv-cache-dtype
  fp8_e5m2`` (the format SGLang's docs give for an FP8 cache without
  calibrated scales); ``--kv_cache_dtype fp8``
* spec_tokens ``k > 0`` (n-gram proposals): ``--speculative-config
  '{"method": "ngram", "num_speculative_tokens": k}'`` (vLLM's docs,
  "Speculative Decoding", "N-Gram Speculation"); ``--speculative-algorithm
  NGRAM --speculative-num-draft-tokens k+1`` (SGLang's docs, "Speculative
  Decoding": its verify step runs ``num_draft_tokens`` tokens per request,
  the last accepted one included, so k proposals are k + 1); TensorRT-LLM
  has no command-line flag: ``speculative_config: {decoding_type: NGram,
  max_draft_len: k}`` in the ``--extra_llm_api_options`` YAML (its docs,
  "Speculative Decoding", ``NGramDecodingConfig``), said in ``notes``
* spec_tokens ``k > 0`` with the draft proposer (the model's draft model,
  Hugging Face id ``D``): ``--speculative-config '{"method": "draft_model",
  "model": "D", "num_speculative_tokens": k}'`` (vLLM's ``SpeculativeConfig``;
  its V1 draft-model proposer runs the draft at the target's tensor
  parallelism, ``draft_tensor_parallel_size`` left at its default, as the
  model counts it); ``--speculative-algorithm STANDALONE
  --speculative-draft-model-path D --speculative-num-steps k
  --speculative-eagle-topk 1 --speculative-num-draft-tokens k+1`` (SGLang's
  docs, "Standalone Speculative Decoding (Small Draft Model)": EAGLE needs a
  trained head, a plain small model is STANDALONE; one chain of k draft
  steps, as the model counts it); TensorRT-LLM again only in the YAML,
  ``speculative_config: {decoding_type: DraftTarget, max_draft_len: k,
  speculative_model_dir: D}`` (its "Speculative Decoding" docs' draft/target
  decoding; the key names were read from the docs, not checked against a
  running server), said in ``notes``
* spec_tokens ``k > 0`` with the eagle3 proposer (an EAGLE-3 head of
  Hugging Face id ``E``): ``--speculative-config '{"method": "eagle3",
  "model": "E", "num_speculative_tokens": k}'`` (vLLM's docs, "EAGLE Draft
  Models", Eagle3 drafter example); ``--speculative-algorithm EAGLE3
  --speculative-draft-model-path E --speculative-num-steps k
  --speculative-eagle-topk 1 --speculative-num-draft-tokens k+1`` (SGLang's
  docs, "Speculative Decoding", EAGLE decoding: one chain of k steps);
  TensorRT-LLM in the YAML, ``speculative_config: {decoding_type: Eagle3,
  max_draft_len: k, speculative_model: E}`` (its LLM API's
  ``Eagle3DecodingConfig``; not checked against a running server), said in
  ``notes``

* prefix caching on (a workload's ``prefix_hit_fraction`` > 0):
  ``--enable-prefix-caching`` (vLLM's "Engine Arguments"; 16-token blocks,
  ``--block-size``, as the model counts its hits); none for SGLang, whose
  radix cache is on unless ``--disable-radix-cache`` ("Server Arguments");
  none for TensorRT-LLM, whose KV block reuse is on unless
  ``kv_cache_config: {enable_block_reuse: false}`` in the
  ``--extra_llm_api_options`` YAML (``KvCacheConfig``); said in ``notes``

* disaggregated prefill/decode pools (``pool_flags``, ``pool_note``): vLLM's
  ``--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role":
  "kv_producer"}'`` on prefill, ``kv_consumer`` on decode (our reading of
  vLLM's ``KVTransferConfig``; its NixlConnector guide starts both pools
  with ``kv_both``), a proxy in front; with a layer-wise transfer
  (``hardware.kv_transfer_layerwise``) the connector is ``LMCacheConnectorV1``
  with ``kv_connector_extra_config: {"use_layerwise": true}`` (vLLM's
  LMCache connector reads that key; its ``save_kv_layer`` sends a layer's
  KV as the layer ends), and the other engines' notes say their pools send
  after the prefill (their layer-wise or chunk-wise transfers are open pull
  requests, 2026-12: ``Engine.layerwise_proposal``); SGLang's ``--disaggregation-mode
  prefill`` / ``decode`` with ``--disaggregation-transfer-backend nixl``
  (the default is Mooncake), ``sglang_router.launch_router
  --pd-disaggregation`` in front (SGLang's docs, "PD Disaggregation");
  TensorRT-LLM has no flags for it: ``cache_transceiver_config: {backend:
  UCX, max_tokens_in_buffer: N}`` in both pools' ``--extra_llm_api_options``
  YAML (``N`` at least the longest prompt), ``disable_overlap_scheduler:
  true`` in the prefill (context) pool's, and ``trtllm-serve disaggregated
  -c disagg_config.yaml`` in front, whose ``context_servers`` and
  ``generation_servers`` give each pool's ``num_instances`` and ``urls``
  (TensorRT-LLM's docs, "Disaggregated Serving"), said in ``notes``

A weight dtype an engine cannot quantise to at load needs a checkpoint
quantised beforehand, whose config the engine reads (no flag): GPTQ or AWQ
for int4 in vLLM, NVFP4 (NVIDIA ModelOpt) for fp4 in vLLM and SGLang, a
ModelOpt FP8, NVFP4 or W4A16-AWQ checkpoint in TensorRT-LLM. ``notes`` says
so in one line per engine instead of inventing a flag.

Sources: vLLM's engine arguments (docs.vllm.ai, "Engine Arguments";
"Quantized KV Cache"); SGLang's server arguments (docs.sglang.io, "Server
Arguments": "To enable fp8 weight quantization, add ``--quantization fp8``
on a fp16 checkpoint", "``--torchao-config int4wo-128``", "To enable fp8 kv
cache quantization, add ``--kv-cache-dtype fp8_e5m2``"); ``trtllm-serve
--help`` (TensorRT-LLM docs, "trtllm-serve"; ``--kv_cache_dtype`` with
``auto``, ``fp8``, ``nvfp4`` since NVIDIA/TensorRT-LLM#11487, March 2026,
earlier ``kv_cache_config: {dtype: fp8}`` in ``--extra_llm_api_options``;
"Quantization": pre-quantised ModelOpt checkpoints).

vLLM's and SGLang's memory settings are both the share of a GPU's memory
for weights plus KV cache (SGLang: "static" memory, the weights and the KV
pool), so the model's ``gpu_memory_utilization`` carries over unchanged.
TensorRT-LLM's is the share of the memory *left after the weights* that
the KV cache takes: with ``M`` bytes per GPU, ``W`` weight bytes per GPU
and utilisation ``u``, the KV cache is ``u·M − W`` bytes, so the fraction
is ``(u·M − W) / (M − W)``. TensorRT-LLM also subtracts its activation
buffers before applying the fraction; the model does not size them, so the
fraction is an upper bound to lower if the engine runs out of memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from sweep.errors import ConfigError


class Engine(NamedTuple):
    """A serving engine's names for the deployment settings."""

    label: str  # how people write its name
    tensor_parallel: str
    concurrency: str
    token_budget: str
    memory: str
    memory_after_weights: bool  # the memory share is of what the weights leave
    # weight dtype -> (flag, value) that quantises bf16 weights as they load;
    # a dtype missing here needs a pre-quantised checkpoint (CHECKPOINTS)
    weight_quantization: dict[str, tuple[str, str]]
    kv_cache_dtype: dict[str, tuple[str, str]]  # KV dtype -> (flag, value)
    checkpoints: dict[str, str]  # weight dtype -> the checkpoint it serves
    # n-gram speculation with k proposals -> its flags (None: no flag; notes)
    speculation: Callable[[int], dict[str, int | str]] | None = None
    # prefix caching on: its flags, or what ``notes`` says where none is needed
    prefix_caching: dict[str, str] | str = ""
    # speculation with k proposals from a draft model or, when the flag is
    # true, an EAGLE-3 head, of that Hugging Face id -> its flags (None: no
    # flag; notes)
    draft_speculation: Callable[[int, str, bool], dict[str, int | str]] | None = None
    # a disaggregated pool ("prefill" or "decode") -> the flags that make an
    # instance one of it
    pools: Callable[[str, bool], dict[str, str]] = lambda pool, layerwise: {}
    # (prefill instances, decode instances, longest prompt or None) -> what
    # the pools' flags leave out: the front that routes requests to them
    pool_note: Callable[[int, int, int | None], str] = lambda p, d, n: ""
    # its pools' flags can send the KV layer by layer (``pools``' second argument)
    layerwise: bool = False
    # where they cannot: the layer-wise transfer proposed for it, unreleased
    layerwise_proposal: str = ""


KV_CONNECTOR = "NixlConnector"
"""The connector in vLLM's pools' flags (``KVTransferConfig.kv_connector``)."""
KV_CONNECTOR_LAYERWISE = "LMCacheConnectorV1"
"""vLLM's connector that sends each layer's KV as it is computed, with
``kv_connector_extra_config: {"use_layerwise": true}`` (its
``save_kv_layer``; ``hardware.kv_transfer_layerwise``)."""
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
"""vLLM's ``kv_role`` of each disaggregated pool."""


def _vllm_pools(pool: str, layerwise: bool) -> dict[str, str]:
    extra = ',"kv_connector_extra_config":{"use_layerwise":true}' if layerwise else ""
    connector = KV_CONNECTOR_LAYERWISE if layerwise else KV_CONNECTOR
    return {"--kv-transfer-config": (
        f'\'{{"kv_connector":"{connector}","kv_role":"{KV_ROLES[pool]}"{extra}}}\'')}


def _vllm_pool_note(p: int, d: int, longest: int | None) -> str:
    return ("--kv-transfer-config is our reading of vLLM's KVTransferConfig "
            "(kv_connector; kv_role kv_producer on prefill, kv_consumer on decode, "
            "kv_both also allowed; vLLM's NixlConnector guide starts both pools with "
            "kv_both); a proxy (vLLM's disaggregated-serving examples) sends each "
            f"request to a prefill instance ({p} here) with max_tokens 1, then to a "
            f"decode instance ({d} here)")


def _sglang_pool_note(p: int, d: int, longest: int | None) -> str:
    return ("a router in front: python -m sglang_router.launch_router "
            "--pd-disaggregation --prefill http://<host:port> --decode "
            f"http://<host:port>, one --prefill per prefill instance ({p}) and one "
            f"--decode per decode instance ({d}); without "
            "--disaggregation-transfer-backend nixl, SGLang moves the KV cache "
            "with Mooncake")


def _trtllm_pool_note(p: int, d: int, longest: int | None) -> str:
    n = "N" if longest is None else str(int(longest))
    return ("disaggregated pools: no flags; both pools' --extra_llm_api_options "
            f"YAML takes cache_transceiver_config: {{backend: UCX, "
            f"max_tokens_in_buffer: {n}}} (at least the longest prompt), the "
            "prefill (context) pool's also disable_overlap_scheduler: true; in "
            "front, trtllm-serve disaggregated -c disagg_config.yaml with "
            f"context_servers: {{num_instances: {p}, urls: [...]}} and "
            f"generation_servers: {{num_instances: {d}, urls: [...]}}")


ENGINES = {
    "vllm": Engine(
        "vLLM", "--tensor-parallel-size", "--max-num-seqs",
        "--max-num-batched-tokens", "--gpu-memory-utilization", False,
        {"fp8": ("--quantization", "fp8")}, {"fp8": ("--kv-cache-dtype", "fp8")},
        {"int4": "a GPTQ or AWQ checkpoint (4-bit, group size 128)",
         "fp4": "an NVFP4 checkpoint (NVIDIA ModelOpt or llm-compressor)"},
        lambda k: {"--speculative-config":
                   f'\'{{"method": "ngram", "num_speculative_tokens": {k}}}\''},
        {"--enable-prefix-caching": ""},
        lambda k, d, eagle: {"--speculative-config":
                             f'\'{{"method": "{"eagle3" if eagle else "draft_model"}", '
                             f'"model": "{d}", "num_speculative_tokens": {k}}}\''},
        pools=_vllm_pools,
        pool_note=_vllm_pool_note, layerwise=True),
    "sglang": Engine(
        "SGLang", "--tp-size", "--max-running-requests", "--chunked-prefill-size",
        "--mem-fraction-static", False,
        {"fp8": ("--quantization", "fp8"), "int4": ("--torchao-config", "int4wo-128")},
        {"fp8": ("--kv-cache-dtype", "fp8_e5m2")},
        {"fp4": "an NVFP4 checkpoint (NVIDIA ModelOpt)"},
        lambda k: {"--speculative-algorithm": "NGRAM",
                   "--speculative-num-draft-tokens": k + 1},
        "prefix caching: SGLang's radix cache is on by default (no flag; "
        "--disable-radix-cache turns it off)",
        lambda k, d, eagle: {
            "--speculative-algorithm": "EAGLE3" if eagle else "STANDALONE",
            "--speculative-draft-model-path": d,
            "--speculative-num-steps": k, "--speculative-eagle-topk": 1,
            "--speculative-num-draft-tokens": k + 1},
        pools=lambda pool, layerwise: {"--disaggregation-mode": pool,
                                       "--disaggregation-transfer-backend": "nixl"},
        pool_note=_sglang_pool_note,
        layerwise_proposal="SGLang's layer-pipelined transfer, "
        "--enable-disagg-layer-pipeline on the Mooncake backend, is an open pull "
        "request, sgl-project/sglang#28529, not in a release"),
    "trtllm": Engine(
        "TensorRT-LLM", "--tp_size", "--max_batch_size", "--max_num_tokens",
        "--kv_cache_free_gpu_memory_fraction", True,
        {}, {"fp8": ("--kv_cache_dtype", "fp8")},
        {"fp8": "an FP8 checkpoint of NVIDIA ModelOpt",
         "int4": "a W4A16 AWQ checkpoint of NVIDIA ModelOpt",
         "fp4": "an NVFP4 checkpoint of NVIDIA ModelOpt"},
        None, "prefix caching: TensorRT-LLM reuses KV blocks by default (no flag; "
        "kv_cache_config: {enable_block_reuse: true} in the --extra_llm_api_options "
        "YAML)", pool_note=_trtllm_pool_note,
        layerwise_proposal="TensorRT-LLM's transfer of each prefill chunk's KV as "
        "the chunk ends is an open pull request, NVIDIA/TensorRT-LLM#15727, not in "
        "a release"),
}
"""Engine name (what ``engine=`` takes) -> its argument names."""

PLAIN = "bf16"
"""The dtype no flag names: the checkpoint's own (every shipped model's)."""


def engine(name: str) -> Engine:
    """The engine called ``name``; one line naming the allowed ones otherwise."""
    if name not in ENGINES:
        raise ConfigError(f"engine={name!r}: unknown engine; allowed: "
                          + ", ".join(ENGINES))
    return ENGINES[name]


def kv_free_fraction(gpu_memory_utilization: float, memory_bytes: float,
                     weight_bytes_per_gpu: float) -> float:
    """TensorRT-LLM's KV share of the memory the weights leave:
    ``(u·M − W) / (M − W)`` (module docstring)."""
    free = memory_bytes - weight_bytes_per_gpu
    return (gpu_memory_utilization * memory_bytes - weight_bytes_per_gpu) / free


def flags(name: str, *, tensor_parallel: int, concurrency: int | None,
          token_budget: int | None, gpu_memory_utilization: float | None,
          memory_bytes: float | None = None, weight_bytes: float | None = None,
          weight_dtype: str = PLAIN, kv_dtype: str = PLAIN, spec_tokens: int = 0,
          prefix_caching: bool = False, draft_model: str = "",
          eagle3: bool = False) -> dict[str, int | float | str]:
    """One deployment's arguments for engine ``name`` (``None``: not set).

    ``weight_bytes`` is the whole model's; TensorRT-LLM's memory fraction
    needs it and ``memory_bytes`` (one GPU's), and is left out without them.
    A ``weight_dtype`` or ``kv_dtype`` other than bf16 adds the engine's
    flag for it where it has one (``notes``: where it has none); so does
    speculation with ``spec_tokens`` proposals per step (n-gram, or from
    the draft model of Hugging Face id ``draft_model`` where one is given,
    an EAGLE-3 head of that id with ``eagle3``),
    and prefix caching (a flag with the value ``""`` stands alone).
    """
    e = engine(name)
    out: dict[str, int | float | str] = {e.tensor_parallel: int(tensor_parallel)}
    for flag, value in ((e.concurrency, concurrency), (e.token_budget, token_budget)):
        if value is not None and math.isfinite(value):
            out[flag] = int(value)
    for table, dtype in ((e.weight_quantization, weight_dtype),
                         (e.kv_cache_dtype, kv_dtype)):
        if dtype in table:
            flag, value = table[dtype]
            out[flag] = value
    if spec_tokens and draft_model:
        if e.draft_speculation is not None:
            out.update(e.draft_speculation(int(spec_tokens), draft_model, eagle3))
    elif spec_tokens and e.speculation is not None:
        out.update(e.speculation(int(spec_tokens)))
    if prefix_caching and isinstance(e.prefix_caching, dict):
        out.update(e.prefix_caching)
    if gpu_memory_utilization is None:
        return out
    if not e.memory_after_weights:
        out[e.memory] = round(float(gpu_memory_utilization), 4)
    elif memory_bytes is not None and weight_bytes is not None:
        out[e.memory] = round(kv_free_fraction(
            gpu_memory_utilization, memory_bytes, weight_bytes / tensor_parallel), 4)
    return out


def pool_flags(name: str, pool: str, layerwise: bool = False) -> dict[str, str]:
    """The flags that make an instance of engine ``name`` one of a
    disaggregated deployment's pools (``pool``: ``prefill`` or ``decode``;
    ``layerwise``: a connector that sends the KV layer by layer, vLLM's
    only)."""
    if pool not in KV_ROLES:
        raise ValueError(f"pool={pool!r}: allowed: " + ", ".join(KV_ROLES))
    return engine(name).pools(pool, layerwise)


def pool_note(name: str, prefill_instances: int, decode_instances: int,
              longest_prompt_tokens: int | None = None, layerwise: bool = False) -> str:
    """What engine ``name``'s pool flags leave out (module docstring)."""
    e = engine(name)
    note = e.pool_note(prefill_instances, decode_instances, longest_prompt_tokens)
    if layerwise and not e.layerwise:
        note += ("; these pools send the KV once the prefill ends: the layer-wise "
                 f"overlap planned here (hardware.kv_transfer_layerwise) is vLLM's "
                 f"{KV_CONNECTOR_LAYERWISE} with use_layerwise"
                 + (f" ({e.layerwise_proposal})" if e.layerwise_proposal else ""))
    return note


def notes(name: str, weight_dtype: str = PLAIN, spec_tokens: int = 0,
          prefix_caching: bool = False, draft_model: str = "",
          eagle3: bool = False) -> list[str]:
    """What the flags cannot say: the checkpoint quantised beforehand that a
    weight dtype needs in engine ``name`` (none for bf16, or where a flag
    quantises at load), and speculation where the engine has no flag."""
    e = engine(name)
    out = []
    if weight_dtype != PLAIN and weight_dtype not in e.weight_quantization:
        out.append(f"{weight_dtype} weights: {e.label} has no flag that quantises to "
                   f"{weight_dtype} as the model loads; serve "
                   f"{e.checkpoints[weight_dtype]}, whose config it reads")
    if spec_tokens and draft_model and e.draft_speculation is None:
        kind, model_key = (("Eagle3", "speculative_model") if eagle3
                           else ("DraftTarget", "speculative_model_dir"))
        out.append(f"{'EAGLE-3' if eagle3 else 'draft-model'} speculation "
                   f"({draft_model}), {int(spec_tokens)} "
                   f"tokens per step: {e.label} takes it in the "
                   f"--extra_llm_api_options YAML, as speculative_config: "
                   f"{{decoding_type: {kind}, max_draft_len: "
                   f"{int(spec_tokens)}, {model_key}: {draft_model}}}")
    elif spec_tokens and not draft_model and e.speculation is None:
        out.append(f"n-gram speculation, {int(spec_tokens)} tokens per step: "
                   f"{e.label} takes it in the --extra_llm_api_options YAML, as "
                   f"speculative_config: {{decoding_type: NGram, max_draft_len: "
                   f"{int(spec_tokens)}}}")
    if prefix_caching and isinstance(e.prefix_caching, str):
        out.append(e.prefix_caching)
    return out


def command_line(values: dict[str, int | float | str]) -> str:
    """``--flag value ...`` (floats as ``%g``)."""
    return " ".join(k if v == "" else f"{k} {v:g}" if isinstance(v, float)
                    else f"{k} {v}" for k, v in values.items())


def bench_command(*, hf_id: str, request_rate_per_s: float, num_prompts: int,
                  prompt_tokens: float, output_tokens: float, ttft_p99_s: float,
                  itl_p99_s: float, cached_tokens: float = 0.0) -> str:
    """A ``vllm bench serve`` run against one replica that checks the
    recommendation: the replica's share of the arrival rate (Poisson, the
    tool's default), prompts and outputs of the workload's mean lengths
    (``random`` dataset), the SLO as ``--goodput`` (milliseconds; vLLM's
    ``tpot``, the mean gap after the first token, stands for the ITL), p50
    and p99 reported, and a result file ``sweep-calibrate`` reads back. With
    ``cached_tokens`` > 0 (prefix caching), each prompt starts with that many
    tokens every prompt shares (``--random-prefix-len``) and the rest are
    random, so the server's cache finds that share of each prompt."""
    shared = round(cached_tokens)
    prefix = f"--random-prefix-len {shared} " if shared > 0 else ""
    return (f"vllm bench serve --model {hf_id or '<hf-model-id>'} "
            f"--dataset-name random {prefix}"
            f"--random-input-len {round(prompt_tokens) - shared} "
            f"--random-output-len {round(output_tokens)} --num-prompts {num_prompts} "
            f"--request-rate {request_rate_per_s:.4g} "
            f"--goodput ttft:{ttft_p99_s * 1e3:g} tpot:{itl_p99_s * 1e3:g} "
            "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 "
            "--save-result --save-detailed")
