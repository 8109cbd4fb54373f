"""Expert parallelism over data-parallel replicas (vLLM's DP attention + EP): MoE layers whose experts span every
rank of two replicas, over real gloo processes, give each replica's tokens the outputs of one unsharded layer
(replicas with different token counts, one idle), and `LLM(data_parallel_size=2, enable_expert_parallel=True)`
gives the greedy tokens of one engine, with requests on one replica only (the other steps idle) and on both."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from deltaserve.config import EngineConfig, ParallelConfig
from deltaserve.config.dp_experts import ExpertReplicas
from deltaserve.utils.ports import free_port

# Tokens per replica in each round, the same on every rank: uneven, one replica idle, both idle.
ROUNDS = [(5, 3), (0, 7), (4, 0), (0, 0), (1, 1)]


def _rank(rank: int, world: int, tp: int, port: int, path: str, out: str) -> None:
    from deltaserve.distributed.replica_experts import init_replica_groups
    from deltaserve.models.loader import load_model

    torch.set_num_threads(1)
    replica = rank // tp
    where = ExpertReplicas(rank=replica, size=world // tp, workers_address=f"tcp://127.0.0.1:{port}",
                           engines_address="tcp://127.0.0.1:1")
    tp_group, exchange = init_replica_groups(where, rank % tp, tp, "cpu")
    one = load_model(path)
    split = load_model(path, tp=tp_group, expert_parallel=True, replicas=exchange)
    errors, sizes = [], []
    for layer_one, layer_split in zip(one.layers, split.layers, strict=True):
        if not layer_one.is_moe:
            continue
        sizes.append(layer_split.mlp.placement.num_local)
        for k, counts in enumerate(ROUNDS):
            g = torch.Generator().manual_seed(100 * k + replica)  # each replica its own tokens
            x = torch.randn(counts[replica], one.config.hidden_size, generator=g)
            exchange.begin_step(counts[replica], "cpu")  # the model's forward does this before its first layer
            with torch.inference_mode():
                a, b = layer_one.mlp(x), layer_split.mlp(x)
            assert b.shape == a.shape
            errors.append(0.0 if a.numel() == 0 else float((a - b).abs().max() / a.abs().max()))
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump((errors, sizes), f)
    torch.distributed.destroy_process_group()
    # Its results are on disk: skip the interpreter's teardown, where gloo's threads still aborted a rank now and
    # then after destroy_process_group ("terminate called without an active exception", exit status -6).
    os._exit(0)


@pytest.mark.parametrize(("variant", "world", "tp"), [
    ("base", 2, 1), ("k3", 2, 1),
    pytest.param("base", 4, 2, marks=pytest.mark.slow),  # CI time: four ranks on two cores
])
def test_experts_over_two_replicas_equal_one_layer(tiny_dir, tmp_path, variant, world, tp):
    path, out = str(tiny_dir(variant)), str(tmp_path / "res")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, tp, port, path, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    for r in range(world):
        with open(f"{out}.{r}", "rb") as f:
            errors, sizes = pickle.load(f)
        # Not bit-equal: the ranks' partial sums are added in another order; a token given another replica's
        # outputs, or an expert computed twice or not at all, would be an O(1) error.
        assert errors and max(errors) < 1e-5, f"rank {r}: {errors}"
        from deltaserve.config import ModelConfig
        experts = ModelConfig.from_pretrained(path).moe.num_experts
        assert set(sizes) == {experts // world}  # every rank of every replica holds its share of whole experts


def test_bad_expert_replica_configs_are_one_line_errors(tiny_dir):
    with pytest.raises(ValueError, match="not 'ray'"):
        ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="ray")
    from deltaserve.config import SpeculativeConfig
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="adaptive verification"):
        EngineConfig(model=str(tiny_dir("base")), speculative_config=spec,
                     parallel=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match=r"expert replica rank 2 is not in \[0, 2\)"):
        ExpertReplicas(rank=2, size=2, workers_address="tcp://127.0.0.1:1", engines_address="tcp://127.0.0.1:2")


PROMPTS = [f"Prompt {i}: a {'short' if i % 3 else 'longer'} sentence about experts and" for i in range(6)]


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="plain"),
    pytest.param({"enable_eplb": True, "num_redundant_experts": 2, "eplb_step_interval": 3}, id="eplb",
                 marks=pytest.mark.slow),  # CI time; EPLB over replicas' ranks is the layer test's placement code
    pytest.param({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, id="ngram"),
])
def test_llm_with_experts_over_replicas_gives_the_greedy_outputs_of_one_engine(tiny_dir, monkeypatch, extra):
    """Also with EPLB rebalancing every 3 forwards (every rank counts the same gathered tokens, so all place alike)
    and with n-gram speculation (one verification forward per step)."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.engine import dp_client
    from deltaserve.executor import worker

    # One torch thread per engine in both runs (GEMM rounding depends on the thread count).
    monkeypatch.setattr(dp_client, "default_num_threads", lambda: 2)
    monkeypatch.setattr(worker, "default_num_threads", lambda: 1)
    path = str(tiny_dir("base"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(model=path, max_model_len=512, data_parallel_size=2, enable_expert_parallel=True, **extra)
    try:
        alone = llm.generate(PROMPTS[:1], params)  # one replica runs, the other joins its exchanges idle
        idle = llm.client.routed.index(0)
        steps = [llm._run(r.get_stats()).steps for r in llm.client.replicas]
        both = llm.generate(PROMPTS, params)
        routed = list(llm.client.routed)
    finally:
        llm.shutdown()
    assert min(routed) > 0 and sum(routed) == len(PROMPTS) + 1
    assert steps[idle] >= steps[1 - idle] > 0  # the replica without a request stepped with the other
    ref = LLM(model=path, max_model_len=512).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in alone] == [ref[0].outputs[0].token_ids]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in ref]


def test_a_dead_replica_takes_the_expert_group_down_with_a_clean_error(tiny_dir):
    """The replicas share their experts, so one killed breaks the other's exchanges: the survivor's engine fails
    with the transport's error and exits, the client's requests end with EngineDeadError, nothing hangs."""
    import asyncio
    import os
    import signal

    from deltaserve import LLM, SamplingParams
    from deltaserve.engine.protocol import EngineDeadError

    llm = LLM(model=str(tiny_dir("base")), max_model_len=512, data_parallel_size=2, enable_expert_parallel=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        assert len(llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 4
        os.kill(llm.client.replicas[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[:2], params)
        llm._run(asyncio.wait_for(llm.client.wait_exited(), 150))  # the survivor exits (gloo's error or timeout)
        assert not llm.client.is_alive
    finally:
        llm.shutdown()


@pytest.mark.slow  # CI time: six processes; DP2 x TP1 and the DP2 x TP2 layer stay in CI
def test_tensor_parallel_replicas_with_experts_over_both_give_the_outputs_of_one_engine(tiny_dir, monkeypatch):
    """DP=2 x TP=2 with the experts over all four ranks: the greedy tokens of one TP=2 engine."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.engine import dp_client

    cores = dp_client.default_num_threads()
    monkeypatch.setattr(dp_client, "default_num_threads", lambda: 2 * cores)  # each rank a reference rank's threads
    path = str(tiny_dir("base"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=path, max_model_len=512, data_parallel_size=2, tensor_parallel_size=2,
              enable_expert_parallel=True)
    try:
        out = llm.generate(PROMPTS[:4], params)
        routed = list(llm.client.routed)
    finally:
        llm.shutdown()
    assert min(routed) > 0
    ref = LLM(model=path, max_model_len=512, tensor_parallel_size=2).generate(PROMPTS[:4], params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_restart_engine_is_refused_with_experts_over_replicas(capsys):
    """A replica restarted alone could not rejoin the others' group: `serve` refuses the combination in one line,
    before starting anything."""
    from deltaserve.entrypoints.cli import main

    rc = main(["serve", "--data-parallel-size", "2", "--enable-expert-parallel", "--restart-engine"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--restart-engine cannot be used with experts over" in err[0]

