"""Device selection end to end (CLI, EngineConfig/LLM, resources, worker group) and the parts of
the CUDA path that are plain arithmetic or run the same on the CPU: KV sizing from device memory,
the warm-up pass, one-copy step uploads, batch buckets and padded graph inputs, device sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbatch.cli.main import main
from kvbatch.engine.runtime import cuda_graphs
from kvbatch.engine.runtime.engine_config import (
    DeviceUnavailableError,
    EngineConfig,
    default_dtype_name,
    kv_blocks_from_memory,
    resolve_device,
)
from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.runtime.model_runner import StepUploader
from kvbatch.engine.runtime.sampler import race, sample, sample_row
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.tiny_models import build_tiny


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine without CUDA, whatever it has (the refusal must not depend on the host)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny("llama", folder)
    return folder


def test_resolve_device(no_cuda, monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    for spec in ("cuda", "cuda:0", "CUDA:1"):
        with pytest.raises(DeviceUnavailableError, match=f"device '{spec}' requested, but CUDA is not available"):
            resolve_device(spec)
    with pytest.raises(DeviceUnavailableError, match="device 'tpu' is not one of auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    # A machine with one GPU: cuda:1 is named as missing, auto and cuda take the current one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(DeviceUnavailableError, match="device 'cuda:1' requested, but this machine has 1 CUDA"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert default_dtype_name(torch.device("cuda", 0)) == "bf16" and default_dtype_name(torch.device("cpu")) == "fp32"


def test_engine_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="matmul_precision"):
        EngineConfig(matmul_precision="tf32")
    with pytest.raises(DeviceUnavailableError, match="'gpu'"):
        EngineConfig(device="gpu")


def test_llm_refuses_a_missing_device_before_reading_weights(no_cuda, tmp_path):
    with pytest.raises(DeviceUnavailableError, match="device 'cuda'"):
        LLM(str(tmp_path / "no-such-model"), engine_config=EngineConfig(device="cuda"))


def test_llm_on_cpu_defaults_to_fp32_and_ieee_matmuls(no_cuda, tiny_llama):
    llm = LLM(str(tiny_llama), engine_config=EngineConfig(block_size=4, num_blocks=8))
    assert llm.device == torch.device("cpu") and llm.dtype == torch.float32
    assert llm.runner.kv_cache.device.type == "cpu" and llm.runner.graphs is None
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cli_refuses_a_missing_device_with_one_line(no_cuda, tmp_path, capsys, device):
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    code = main(["generate", "--model", str(tmp_path / "never-read"), "--input", str(src),
                 "--output", str(tmp_path / "out.jsonl"), "--no-progress", "--device", device])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    why = "no CUDA build" if torch.version.cuda is None else "no GPU visible"
    assert err == [(f"kvbatch: error: device '{device}' requested, but CUDA is not available on this machine "
                    f"(torch {torch.__version__}, {why})")]
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_device_flags_reach_the_engine(no_cuda, tiny_llama):
    """--device cpu --enforce-eager --gpu-memory-utilization: the engine is built with them, and
    the default dtype follows the device (fp32 on the CPU)."""
    from kvbatch.cli.main import _load_llm, _resolve_device, build_parser

    for command in ("generate", "prefill", "decode"):
        io = {"generate": ["--input", "i", "--output", "o"],
              "prefill": ["--input", "i", "--manifests", "m", "--store", "s"],
              "decode": ["--manifests", "m", "--output", "o", "--store", "s"]}[command]
        args = build_parser().parse_args([command, "--model", str(tiny_llama), *io, "--device", "cpu",
                                          "--enforce-eager", "--gpu-memory-utilization", "0.5"])
        assert _resolve_device(args) is None
        assert (args.device, args.dtype, args.enforce_eager, args.gpu_memory_utilization) == ("cpu", "fp32", True, 0.5)
    args = build_parser().parse_args(["generate", "--model", str(tiny_llama), "--input", "i", "--output", "o",
                                      "--device", "auto", "--enforce-eager", "--gpu-memory-utilization", "0.5"])
    assert _resolve_device(args) is None and args.device == "cpu"
    llm = _load_llm(args)
    ec = llm.engine_config
    assert (ec.device, ec.enforce_eager, ec.gpu_memory_utilization, llm.dtype) == ("cpu", True, 0.5, torch.float32)
    args.gpu_memory_utilization = 1.5
    assert _resolve_device(args) == "--gpu-memory-utilization must be in (0, 1], got 1.5"


def test_resources_carry_the_device(monkeypatch):
    from kvbatch.resources.decode_cluster import DecodeClusterResource
    from kvbatch.resources.model import ModelResource

    ec = ModelResource(device="cuda:0", gpu_memory_utilization=0.8, enforce_eager=True).engine_config()
    assert (ec.device, ec.gpu_memory_utilization, ec.enforce_eager) == ("cuda:0", 0.8, True)
    with pytest.raises(Exception, match="'tpu' is not one of"):
        ModelResource(device="tpu")
    assert DecodeClusterResource(device="cpu").resolved_backend() == "gloo"
    assert DecodeClusterResource(device="cpu").worker_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert DecodeClusterResource(launcher="local", world_size=2).resolved_backend() == "nccl"
    assert DecodeClusterResource(launcher="local", world_size=2).worker_device() == "cuda"
    assert DecodeClusterResource(device="cpu", launcher="local", world_size=2).resolved_backend() == "gloo"
    with pytest.raises(Exception, match="one GPU per rank"):
        DecodeClusterResource(launcher="local", world_size=2, device="cuda:1")
    with pytest.raises(Exception, match="backend 'nccl' moves CUDA tensors only"):
        DecodeClusterResource(backend="nccl", device="cpu")


def test_nccl_group_without_cuda_fails_at_once(no_cuda, monkeypatch):
    from kvbatch.ops.decode.group import init_group

    monkeypatch.setenv("KVBATCH_DIST_BACKEND", "nccl")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="KVBATCH_DIST_BACKEND=nccl, but CUDA is not available"):
        init_group()


def test_kv_blocks_from_memory():
    gib = 1 << 30
    # 0.9 of 80 GiB = 72 GiB allowed; 16 held and 4 of activations leave 52 GiB of 2 MiB blocks.
    assert kv_blocks_from_memory(80 * gib, 16 * gib, 4 * gib, 0.9, 2 << 20) == 52 * 512
    with pytest.raises(ValueError, match="no room for the KV cache: 0.50 x 8.0 GiB allowed, 4.00 GiB held"):
        kv_blocks_from_memory(8 * gib, 4 * gib, 1 * gib, 0.5, 1 << 20)


def test_warmup_pass_runs_a_full_step_budget(tiny_llama):
    llm = LLM(str(tiny_llama), engine_config=EngineConfig(block_size=4, num_blocks=8, device="cpu"))
    ec = EngineConfig(block_size=4, max_num_batched_tokens=40)
    tokens = cuda_graphs.warmup_tokens(ec, llm.max_model_len)
    assert tokens == 40 and cuda_graphs.warmup_tokens(ec, 10) == 9
    scratch = cuda_graphs.warmup_pass(llm.model, tokens, 4, 8, llm.dtype)
    assert scratch == 10 * llm.block_bytes  # 40 tokens in blocks of 4


def test_warmup_pass_runs_a_full_decode_step_and_frees_its_scratch(tiny_llama, monkeypatch):
    """The KV budget is measured after the widest decode step too (max_num_seqs rows at the longest
    context), and the scratch cache is freed although the model still holds views of it: otherwise
    the cache is sized from memory the scratch still takes."""
    from kvbatch.engine.runtime.model_runner import ModelRunner

    llm = LLM(str(tiny_llama), engine_config=EngineConfig(block_size=4, num_blocks=8, device="cpu"))
    steps, runners = [], []
    real_run = ModelRunner.run

    def spy(self, items, *args, **kwargs):
        steps.append([(len(i.tokens), i.start) for i in items])
        runners.append(self)
        return real_run(self, items, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "run", spy)
    cuda_graphs.warmup_pass(llm.model, 40, 4, 8, llm.dtype, decode_rows=6, context_len=30)
    assert steps == [[(40, 0)], [(1, 29)] * 6]  # the prefill, then 6 rows decoding at position 29
    # Released (what release frees is tests/test_device_placement.py's, on an emulated GPU: on the
    # CPU the cache may live in a huge-page arena that is not freed piecewise).
    assert runners[0].released


def test_step_uploader_on_cpu_packs_every_array():
    up = StepUploader(torch.device("cpu"))
    a, b, c = up.upload([[1, 2, 3], [], [7]])
    assert a.tolist() == [1, 2, 3] and b.numel() == 0 and c.tolist() == [7] and a.dtype == torch.int64
    assert up.copies == 0  # nothing to copy on the CPU


def test_buckets_and_padded_decode_inputs():
    assert cuda_graphs.batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert cuda_graphs.batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert cuda_graphs.bucket_for(5, [1, 2, 4, 8]) == 8 and cuda_graphs.bucket_for(9, [1, 2, 4, 8]) is None
    x = cuda_graphs.pad_decode_inputs([11, 12], [5, 0], [[3, 9], [4]], bucket=4, width=3, block_size=4)
    assert x.ids == [11, 12, 0, 0] and x.positions == [5, 0, 0, 0]
    assert x.slots == [9 * 4 + 1, 4 * 4, -1, -1]  # padded rows write nothing (store_kv skips -1)
    assert x.tables == [3, 9, 0, 4, 0, 0] + [0] * 6 and x.context_lens == [6, 1, 1, 1]


def test_graphs_stay_off_where_they_cannot_run(tiny_llama):
    llm = LLM(str(tiny_llama), engine_config=EngineConfig(block_size=4, num_blocks=8, device="cpu"))
    assert cuda_graphs.graphs_unsupported(llm.runner) == "not on CUDA"
    with pytest.warns(UserWarning, match="CUDA graphs off: not on CUDA"):
        assert cuda_graphs.CudaGraphRunner.capture(llm.runner, 4, 32) is None


def test_device_sampling_draws_the_host_generator_stream():
    """The race reads its noise from the request's host generator: the same seed gives the same
    token alone or in a batch, and ``sample`` agrees with ``sample_row`` row by row."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2)]

    def gens():
        return [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]

    batched = sample(logits, params, gens())
    g = gens()
    alone = [sample_row(logits[i], params[i], g[i]) for i in range(3)]
    assert batched == alone
    assert batched[1] == int(logits[1].argmax())
    assert int(race(logits[0], params[0], torch.Generator().manual_seed(7))) == batched[0]

