"""Derives the shipped calibration profiles from public measured data, and the
held-out prediction error before and after calibration.

Sources, read where they live (never copied into the repository):

* NVIDIA aiconfigurator's performance databases (the ``aiconfigurator-core``
  wheel on PyPI, Apache-2.0; ``pip install aiconfigurator-core==0.12.0
  pyarrow``): per-kernel latencies measured on each GPU with vLLM, SGLang
  and TensorRT-LLM. A step of a dense model is composed from them: per
  layer the QKV, output, gate-up and down GEMMs (bf16) and the attention
  kernel (decode: ``generation_attention`` at batch B and KV length c;
  prefill: ``context_attention`` of one prompt), plus the LM head. Norms,
  rotary embedding, sampling and the engine's CPU work are not in these
  tables; the fitted constants describe the kernels.
* Vidur's per-layer operator profiles (``../shared/data/vidur/``, MIT):
  every non-attention operator of one Llama-2 layer (projections, MLP,
  norms, rotary, residual add) at 1..4,096 tokens on A100 and H100, TP 1.
  A step is the layers times their sum, predicted by the model's linear
  part alone (no KV cache, no attention).

Points: decode steps at batch 1..256 (powers of two) and KV length 1,023 and
4,095 tokens; prefills of one 1k..16k-token prompt (aiconfigurator's
attention tables stop at 16,384 tokens; Vidur's at 4,096). Held out: batch
2, 8, 32, 128 and prompts of 2k and 8k (Vidur: 512 and 2,048); the
constants are fitted on the rest (``sweep.search.calibrate.fit``, the optax fit of
``sweep-calibrate``): the bound's three (``mbu``, ``mfu``,
``step_overhead_s``), then the step's measured shape, ``kv_mbu`` and
``sequence_overhead_s`` with ``mbu`` and ``mfu`` (one tensor-parallel size
cannot tell a dense model's step overhead from its weights' time:
``sweep.search.calibrate.identified``), and the latter ship. Vidur's rows have
neither KV cache nor sequences: three constants.

Usage::

    python benchmarks/measured_profiles.py            # print the tables
    python benchmarks/measured_profiles.py --write    # also conf/calibration/

Prints one Markdown table per source (held-out mean and worst relative
error, decode and prefill, bound -> calibrated) for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
# the public data beside the checkout (CI's layout), or where SWEEP_DATA_DIR says
VIDUR = Path(os.environ.get("SWEEP_DATA_DIR") or REPO.parent / "shared" / "data"
             ) / "vidur"

DECODE_BATCH = [2**i for i in range(9)]
CONTEXTS = [1023, 4095]
PREFILL = [1024, 2048, 4096, 8192, 16384]
HELD_BATCH = {2, 8, 32, 128}
HELD_PREFILL = {2048, 8192}

# aiconfigurator system -> this project's hardware option
SYSTEMS = {"h100_sxm": "h100_sxm", "h200_sxm": "h200_sxm", "b200_sxm": "b200",
           "a100_sxm": "a100_80gb_sxm", "l40s": "l40s"}
# this project's model option -> aiconfigurator's copy of its config.json
MODELS = {"qwen3_8b": "Qwen--Qwen3-8B", "llama3_1_8b": "meta-llama--Meta-Llama-3.1-8B",
          "qwen3_32b": "Qwen--Qwen3-32B"}
ENGINES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}
AIC_LICENSE = "Apache-2.0"


@dataclass
class Dataset:
    """Measured steps of one source x hardware x model x engine."""

    source: str
    version: str
    license: str
    hardware: str
    model: str
    engine: str
    rows: list[tuple[float, float, float, float, bool]] = field(default_factory=list)
    # (batch_size, context_tokens, prefill_tokens, seconds, held_out)
    model_spec: object = None  # a schema Model when not a shipped option
    # whether batch_size counts sequences (Vidur's rows are token counts of
    # the linear layers: no KV cache, no sequences, three constants only)
    sequences: bool = True


def _version_dirs(root: Path, needs: str) -> Path | None:
    """The newest version folder under ``root`` that holds ``needs``."""
    dirs = [d for d in root.iterdir() if (d / needs).is_file()] if root.is_dir() else []
    key = lambda d: [int(x) if x.isdigit() else -1  # noqa: E731
                     for x in d.name.replace("rc", ".").replace("post", ".").split(".")]
    return max(dirs, key=key) if dirs else None


class Gemm:
    """bf16 GEMM latencies (ms) of one system and engine, interpolated in n, k."""

    def __init__(self, path: Path):
        d = pd.read_parquet(path, columns=["gemm_dtype", "m", "n", "k", "latency"])
        d = d[d.gemm_dtype == "bfloat16"].groupby(["m", "n", "k"]).latency.min()
        self.table = d
        self.ns = np.array(sorted(d.index.get_level_values("n").unique()))
        self.ks = np.array(sorted(d.index.get_level_values("k").unique()))

    def _at(self, m, n, k) -> float:
        return float(self.table.loc[(m, n, k)])

    def __call__(self, m: int, n: int, k: int) -> float:
        if n > self.ns[-1]:  # a wider GEMM as several (weight-bound: additive)
            return self(m, int(self.ns[-1]), k) + self(m, n - int(self.ns[-1]), k)

        def along(values, x):
            i = int(np.searchsorted(values, x))
            if i < len(values) and values[i] == x:
                return [(int(x), 1.0)]
            lo, hi = values[max(i - 1, 0)], values[min(i, len(values) - 1)]
            w = (x - lo) / (hi - lo)
            return [(int(lo), 1 - w), (int(hi), w)]

        return sum(wn * wk * self._at(m, n_, k_) for n_, wn in along(self.ns, n)
                   for k_, wk in along(self.ks, k))


class Attention:
    """Attention kernel latencies (ms): decode at (batch, KV length), prefill."""

    def __init__(self, folder: Path, heads: int, kv_heads: int, head_dim: int):
        def load(name):
            d = pd.read_parquet(folder / f"{name}_attention_perf.parquet")
            keep = ((d.num_heads == heads) & (d.num_key_value_heads == kv_heads)
                    & (d.head_dim == head_dim) & (d.kv_cache_dtype == "bfloat16"))
            if "window_size" in d.columns:  # sliding windows: not these models
                keep &= d.window_size == 0
            return d[keep]

        self.gen = load("generation").groupby(["batch_size", "step"]).latency.min()
        self.ctx = load("context")
        self.ctx = self.ctx[self.ctx.batch_size == 1].groupby("isl").latency.min()

    def decode(self, batch: int, context: int) -> float:
        return float(self.gen.loc[(batch, context)])

    def prefill(self, tokens: int) -> float:
        return float(self.ctx.loc[tokens])


def aiconfigurator_datasets() -> list[Dataset]:
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or importlib.util.find_spec("pyarrow") is None:
        print("aiconfigurator-core (with pyarrow) is not installed: "
              "pip install aiconfigurator-core==0.12.0 pyarrow", file=sys.stderr)
        return []
    root = Path(spec.origin).parent
    version = importlib.metadata.version("aiconfigurator-core")
    out = []
    for system, hw in SYSTEMS.items():
        for engine in ENGINES:
            data = root / "systems" / "data" / system
            gdir = _version_dirs(data / "gemm" / engine, "gemm_perf.parquet")
            adir = _version_dirs(data / "attention" / engine,
                                 "generation_attention_perf.parquet")
            if gdir is None or adir is None:
                continue
            gemm = Gemm(gdir / "gemm_perf.parquet")
            for model, cfg_name in MODELS.items():
                cfg = json.loads((root / "model_configs" / f"{cfg_name}_config.json")
                                 .read_text())
                h, inter = cfg["hidden_size"], cfg["intermediate_size"]
                q, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
                hd = cfg.get("head_dim") or h // q
                layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
                try:
                    attn = Attention(adir, q, kv, hd)
                except (FileNotFoundError, KeyError):
                    continue

                def linear(m):
                    per_layer = (gemm(m, (q + 2 * kv) * hd, h) + gemm(m, h, q * hd)
                                 + gemm(m, 2 * inter, h) + gemm(m, h, inter))
                    return layers * per_layer + gemm(m, vocab, h)

                ds = Dataset("NVIDIA aiconfigurator performance database "
                             "(per-kernel latencies)",
                             f"aiconfigurator-core {version}, {engine} {gdir.name}",
                             AIC_LICENSE, hw, model, engine)
                points = [(b, c, 0, b in HELD_BATCH) for b in DECODE_BATCH
                          for c in CONTEXTS]
                points += [(1, 0, p, p in HELD_PREFILL) for p in PREFILL]
                for b, c, p, held in points:
                    try:
                        ms = (linear(b) + layers * attn.decode(b, c) if p == 0
                              else linear(p) + layers * attn.prefill(p))
                    except KeyError:
                        continue  # a shape the database does not hold
                    ds.rows.append((b, c, p, ms / 1e3, held))
                if ds.rows:
                    out.append(ds)
    return out


VIDUR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj",
             "add")
VIDUR_MODELS = {"Llama-2-7b-hf": ("llama2_7b", 32),
                "Llama-2-70b-hf": ("llama2_70b", 80)}  # num_hidden_layers
VIDUR_DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
VIDUR_PREFILL = [512, 1024, 2048, 4096]
VIDUR_HELD = {2, 8, 32, 128, 512, 2048}


def vidur_datasets() -> list[Dataset]:
    from sweep.config.schema import Model

    out = []
    for gpu, hw in (("a100", "a100_80gb_sxm"), ("h100", "h100_sxm")):
        for file_model, (name, layers) in VIDUR_MODELS.items():
            path = VIDUR / f"{gpu}_{file_model}_mlp.csv"
            if not path.exists():
                print(f"{path}: not found", file=sys.stderr)
                continue
            d = pd.read_csv(path)
            d = d[d.num_tensor_parallel_workers == 1]
            r = d.iloc[0]
            h, inter = int(r.n_embd), int(r.n_expanded_embd)
            q, kv = int(r.n_head), int(r.n_kv_head)
            hd = h // q
            # the linear part alone: what the measured operators compute
            params = layers * (h * (q + 2 * kv) * hd + q * hd * h + 3 * h * inter)
            spec = Model(name=f"{name}_linear", params=float(params),
                         active_params=float(params), layers=layers, q_heads=q,
                         kv_heads=kv, head_dim=hd, hidden_size=h)
            per_layer = d.groupby("num_tokens")[[f"time_stats.{o}.median"
                                                 for o in VIDUR_OPS]].mean().sum(axis=1)
            ds = Dataset("Vidur per-layer operator profiles (non-attention, TP 1)",
                         "microsoft/vidur 7d47513", "MIT", hw, name, "vllm",
                         model_spec=spec, sequences=False)
            for t in VIDUR_DECODE + VIDUR_PREFILL:
                ds.rows.append((t, 0, 0, layers * per_layer.loc[t] / 1e3,
                                t in VIDUR_HELD))
            out.append(ds)
    return out


def _specs(ds: Dataset):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from sweep.config.store import register_configs

    register_configs()
    with initialize_config_module("sweep.conf", version_base="1.3"):
        app = OmegaConf.to_object(compose("calibrate", [
            f"hardware={ds.hardware}", "model=qwen3_8b", "steps_csv=[x]"]))
        model = ds.model_spec
        if model is None:
            model = OmegaConf.to_object(compose("calibrate", [
                f"model={ds.model}", "steps_csv=[x]"])).model
    return app.hardware, model


@dataclass
class Evaluated:
    ds: Dataset
    constants: dict[str, float]
    errors: dict[str, tuple[float, float, float, float]]
    # group -> mean and worst held-out error: bound, three constants, five
    rms: float  # root-mean-square relative error on the points fitted


def evaluate(ds: Dataset) -> Evaluated:
    """Fits on the rows not held out, the three constants of the bound
    (``mbu``, ``mfu``, ``step_overhead_s``) and then all five (with
    ``kv_mbu`` and ``sequence_overhead_s``: what ships), and measures both
    on the held-out rows."""
    from sweep.cli.calibrate_io import StepTable
    from sweep.config.convert import hardware_params, model_params
    from sweep.search import calibrate

    hw_cfg, model_cfg = _specs(ds)
    hw = calibrate._scalars(hardware_params(hw_cfg, 1.0))
    model = calibrate._scalars(model_params(model_cfg))
    rows = np.array([r[:4] for r in ds.rows], np.float64)
    held = np.array([r[4] for r in ds.rows])

    def steps(mask):
        x = rows[mask]
        return calibrate.steps_input([StepTable(
            ds.source, x[:, 0], x[:, 1], x[:, 2], np.ones(len(x)), x[:, 3])])

    def predicted(c, mask):
        out = calibrate.predict(hw, model, calibrate.log_constants(c), steps(mask),
                                None)["steps_s"]
        return np.asarray(out)[:int(mask.sum())]

    def fitted(names):
        res = calibrate.fit(hw, model, steps(~held), None, fit=names)
        c = dict(zip(calibrate.CONSTANTS, np.exp(np.asarray(res.log_constants,
                                                            np.float64))))
        if "kv_mbu" not in names:
            c["kv_mbu"] = c["mbu"]
        return calibrate.rounded(c)

    three = fitted(calibrate.CONSTANTS[:3])
    # dense models at TP 1: the overhead is not told from the weights' time
    # (sweep.search.calibrate.identified), so it stays 0 and mbu takes it
    five = (fitted(("mbu", "mfu", "kv_mbu", "sequence_overhead_s")) if ds.sequences
            else three)
    rms = float(np.sqrt(np.mean((predicted(five, ~held) / rows[~held, 3] - 1) ** 2)))
    measured = rows[held, 3]
    bound = predicted({"mbu": 1.0, "mfu": 1.0, "step_overhead_s": 0.0,
                       "kv_mbu": 1.0, "sequence_overhead_s": 0.0}, held)
    prefill = (rows[held, 2] > 0) | (rows[held, 0] >= 512)
    errors = {}
    for group, mask in (("decode", ~prefill), ("prefill", prefill)):
        errors[group] = tuple(
            f(np.abs(p[mask] / measured[mask] - 1))
            for p in (bound, predicted(three, held), predicted(five, held))
            for f in (np.mean, np.max))
    ratio = measured / bound
    errors["ratio"] = (ratio[~prefill].min(), ratio[~prefill].max(),
                       ratio[prefill].min(), ratio[prefill].max())
    return Evaluated(ds, five, errors, rms)


def _pct(x: float) -> str:
    return f"{x * 100:.1f}"


def markdown(results: list[Evaluated]) -> str:
    lines = ["| hardware | model | engine | mbu | kv_mbu | mfu | overhead ms | us / "
             "sequence | measured / bound: decode | prefill | held-out decode error "
             "%, mean / worst: bound -> 3 constants -> shipped | held-out "
             "prefill error %, same |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- "
             "| --- |"]

    def cell(e):
        return " -> ".join(f"{_pct(e[i])} / {_pct(e[i + 1])}" for i in (0, 2, 4))

    for r in results:
        q, c = r.errors["ratio"], r.constants
        lines.append(
            f"| {r.ds.hardware} | {r.ds.model} | {r.ds.engine} | {c['mbu']:.3f} | "
            f"{c['kv_mbu']:.3f} | {c['mfu']:.3f} | {c['step_overhead_s'] * 1e3:.3f} | "
            f"{c['sequence_overhead_s'] * 1e6:.2f} | {q[0]:.2f}-{q[1]:.2f} | "
            f"{q[2]:.2f}-{q[3]:.2f} | {cell(r.errors['decode'])} | "
            f"{cell(r.errors['prefill'])} |")
    return "\n".join(lines)


HEADER = """\
# Generated by benchmarks/measured_profiles.py from {what}:
# measured constants per hardware x model x engine, fitted
# (sweep.search.calibrate.fit) on part of each source; benchmarks/README.md gives
# the held-out error before and after.
# Regenerate with: python benchmarks/measured_profiles.py --write
#   {usage}
"""


def write_config(name: str, what: str, usage: str, results: list[Evaluated],
                 engine: str = "vllm") -> Path:
    from omegaconf import OmegaConf

    profiles = []
    for r in results:
        _, model = _specs(r.ds)
        profiles.append({
            "hardware": r.ds.hardware, "model": r.ds.model, "engine": r.ds.engine,
            **{k: v for k, v in r.constants.items() if k != "kv_mbu"},
            "kv_mbu": 0.0 if r.constants["kv_mbu"] == r.constants["mbu"]
            else r.constants["kv_mbu"], "source": r.ds.source,
            "version": r.ds.version, "license": r.ds.license,
            "active_params": float(model.active_params),
            "fitted_points": int(sum(not x[4] for x in r.ds.rows)),
            "rms_relative_error": round(r.rms, 4)})
    body = OmegaConf.to_yaml({"defaults": ["base_calibration", "_self_"],
                              "name": name, "engine": engine, "profiles": profiles})
    path = REPO / "conf" / "calibration" / f"{name}.yaml"
    path.write_text(HEADER.format(what=what, usage=usage) + body)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="write conf/calibration/auto.yaml and vidur.yaml")
    args = ap.parse_args()
    aic = [evaluate(ds) for ds in aiconfigurator_datasets()]
    vid = [evaluate(ds) for ds in vidur_datasets()]
    for title, results in (("NVIDIA aiconfigurator", aic), ("Vidur", vid)):
        if results:
            print(f"\n### {title}\n")
            print(markdown(results))
    if args.write:
        if aic:
            print(write_config(
                "auto", "NVIDIA aiconfigurator's performance databases",
                "sweep-grid calibration=auto [calibration.engine=sglang]", aic))
        if vid:
            print(write_config("vidur", "Vidur's measured operator profiles",
                               "sweep-grid calibration=vidur", vid))


if __name__ == "__main__":
    main()
