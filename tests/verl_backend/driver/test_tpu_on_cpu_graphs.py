"""The graphs a ``tpu-on-cpu`` run executed, counted and set against the job's bucket plan
(:mod:`verl_backend.driver.aot.executed`, issue #43 item 2): the stats files the workers write, read back; a graph
inside the buckets is in the plan, an unpadded prompt length or a removed response bucket is named with its shape.
No torch-tpu needed: the rows are what :class:`verl_backend.tpu_on_cpu.GraphStats` writes."""

from __future__ import annotations

import json
import os

import pytest

from verl_backend.driver.aot.executed import executed_entry, graph_request, read_stats
from verl_backend.driver.aot.graphs import GraphRequest, job_graphs, planned_graphs, planned_shapes
from verl_backend.driver.job_shape import job_shape

CONFIG = {
    "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 16},
    "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1},
        "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 1, "max_num_seqs": 8},
        "ref": {"log_prob_micro_batch_size_per_gpu": 1},
        "model": {"path": ""},
    },
    "trainer": {"nnodes": 1, "n_gpus_per_node": 4},
}


def row(region, part, inputs, key, runs=1, lowered="xla-cpu"):
    return {
        "name": f"{region}.{part}0",
        "region": region,
        "part": part,
        "inputs": inputs,
        "key": key,
        "lowered": lowered,
        "cached": False,
        "lower_s": 0.5,
        "compile_s": 1.0,
        "runs": runs,
        "run_s": 0.1,
        "copy_s": 0.01,
    }


def write(folder, process, rows):
    (folder / "stats").mkdir(parents=True, exist_ok=True)
    (folder / "stats" / f"{process}.json").write_text(json.dumps(rows))


@pytest.fixture
def job():
    return job_shape(CONFIG, workers=4)


def test_the_plan_allows_the_buckets_the_sampler_and_the_trainer_pad_to(job):
    plan = planned_shapes(job)
    assert (1, 64, 80) in plan["prefill"] and (1, 16, 32) in plan["prefill"]  # prompt buckets 16, 32, 64
    assert (1, 1, 80) in plan["decode"] and (1, 1, 32) in plan["decode"]
    assert (8, 1, 80) in plan["decode"] and (16, 1, 80) not in plan["decode"]  # up to max_num_seqs (validation's too)
    assert (1, 37, 53) not in plan["prefill"]  # an unpadded prompt is no bucket
    assert (1, 16, 80) not in plan["prefill"]  # the cache is the prompt's own bucket plus a generation bucket
    assert (1, 64, 0) in plan["block"] and (1, 128, 0) in plan["block"]  # 64 + 16 tokens pad to 128
    assert (1, 256, 0) not in plan["block"]


def test_aot_all_buckets_lists_every_graph_the_plan_allows(job):
    """``--aot-only --aot-all-buckets`` compiles :func:`planned_graphs`: every planned shape once, each trainer block
    shape with its head, and the largest graphs ``--aot-only`` compiles by default among them."""
    graphs = planned_graphs(job)
    assert len(graphs) == len(set(graphs))
    plan = planned_shapes(job)
    for kind in ("prefill", "decode", "block", "block_forward"):
        assert {(g.batch, g.seq, g.cache) for g in graphs if g.kind == kind} == plan[kind], kind
    blocks = {(g.batch, g.seq) for g in graphs if g.kind == "block"}
    assert blocks == {(g.batch, g.seq) for g in graphs if g.kind == "lm_head"}
    assert set(job_graphs(job)) <= set(graphs)
    assert GraphRequest("decode", 8, 1, 80) in graphs and GraphRequest("decode", 16, 1, 80) not in graphs


def test_aot_all_buckets_reaches_the_lowering_subprocess(tmp_path, job):
    """What ``run_aot_only(all_buckets=True)`` hands the lowering subprocess: the plan's graphs, split into the
    trainer's (its FSDP dtype) and the sampler's (the rollout's dtype); by default only the largest."""
    from verl_backend.driver.aot.job import aot_jobs

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    every = aot_jobs(job, model_path=str(tmp_path), requests=planned_graphs(job))
    largest = aot_jobs(job, model_path=str(tmp_path))
    assert sum(len(j["graphs"]) for j in every) == len(planned_graphs(job)) > sum(len(j["graphs"]) for j in largest)
    assert {g["kind"] for g in every[1]["graphs"]} == {"prefill", "decode"}


def test_aot_all_buckets_reaches_run_aot_only(monkeypatch, tmp_path):
    """``verl train --backend tpu --aot-only --aot-all-buckets`` hands ``all_buckets=True`` to ``run_aot_only``
    (nothing compiles here: the call is caught); without the flag, ``False``."""
    import verl_backend.driver.aot.job as aot_job
    from verl_backend.driver.cli import main

    caught = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(
        aot_job,
        "run_aot_only",
        lambda config, slice_name, model_path=None, all_buckets=False: caught.append(all_buckets) or 0,
    )
    for extra in (["--aot-all-buckets"], []):
        argv = ["train", "--backend", "tpu", "--aot-only", "--slice", "v6e-8", *extra]
        assert main([*argv, "--output-dir", str(tmp_path / str(len(extra)))]) == 0
    assert caught == [True, False]


def test_aot_all_buckets_needs_aot_only(capsys):
    from verl_backend.driver.cli import main

    assert main(["train", "--backend", "tpu", "--aot-all-buckets"]) == 2
    assert "--aot-all-buckets chooses the graphs --aot-only compiles: give --aot-only too" in capsys.readouterr().err


def test_a_run_s_graphs_counted_and_set_against_the_plan(tmp_path, job):
    prefill = row("sampler", "inf", {"L_ids_": [1, 64], "L_mask_": [1, 80], "L_pos_": [1, 64]}, "p", runs=2)
    decode = row("sampler", "inf", {"L_ids_": [1, 1], "L_mask_": [1, 80], "L_pos_": [1, 1]}, "d", runs=30)
    fwd = row("actor.block", "fwd", {"L_hidden_states_": [1, 128, 64]}, "f", runs=4)
    bwd = row("actor.block", "bwd", {"L_hidden_states_": [1, 128, 64]}, "b", runs=4)
    ref = row("reference.block", "inf", {"L_hidden_states_": [1, 128, 64]}, "r", runs=4)
    # two ranks; rank 1 traced the same graphs (one distinct graph each), the 2 blocks of its model share a key
    write(tmp_path, "host-1", [prefill, decode, fwd, fwd, bwd, ref])
    write(tmp_path, "host-2", [prefill, decode, fwd, bwd, ref])
    (tmp_path / "stats" / ".host-3.json.tmp").write_text("[{")  # a process killed mid-write: not read
    write(tmp_path, "host-0", [prefill, decode])  # an earlier run's process, in a folder runs share
    os.utime(tmp_path / "stats" / "host-0.json", (1e9, 1e9))
    assert len(read_stats(tmp_path)) == 13 and len(read_stats(tmp_path, since=1.5e9)) == 11
    entry = executed_entry(tmp_path, job, since=1.5e9)
    assert entry["traced"] == 11 and entry["distinct"] == 5
    assert entry["executions"] == 2 * (2 + 30 + 4 + 4 + 4) + 4
    assert entry["by_kind"]["sampler.inf"] == {"traced": 4, "distinct": 2, "executions": 64}
    assert entry["outside_plan"] == [] and entry["eager"] == 0
    assert "5 distinct graphs (11 traced in 2 processes)" in entry["line"]
    assert "0 outside the bucket plan" in entry["line"]


def test_a_shape_that_escapes_the_buckets_is_named(tmp_path, job):
    """The negative control: a prefill at an unpadded prompt length (37), and a decode against a cache whose response
    bucket the plan lacks (64 + 100), are each named with their shapes."""
    write(
        tmp_path,
        "host-1",
        [
            row("sampler", "inf", {"L_ids_": [1, 37], "L_mask_": [1, 53]}, "p"),
            row("sampler", "inf", {"L_ids_": [1, 1], "L_mask_": [1, 164]}, "d"),
            row("actor.block", "fwd", {"L_hidden_states_": [1, 128, 64]}, "f"),
            row("actor.block", "bwd", {"x": [3]}, "odd", lowered="eager: TorchTPU cannot lower aten.foo"),
        ],
    )
    entry = executed_entry(tmp_path, job)
    assert entry["outside_plan"][:2] == ["sampler.prefill[1x37|cache 53]", "sampler.decode[1x1|cache 164]"]
    assert len(entry["outside_plan"]) == 3  # and the graph whose shapes say nothing: named with its inputs
    assert "3 outside the bucket plan: sampler.prefill[1x37|cache 53]" in entry["line"]
    assert entry["eager"] == 1 and entry["eager_lines"] == ["TorchTPU cannot lower aten.foo"]


def test_the_region_inputs_name_the_graph():
    assert graph_request(row("sampler", "inf", {"L_ids_": [8, 1], "L_mask_": [8, 80]}, "k")).name == (
        "sampler.decode[8x1|cache 80]"
    )
    assert graph_request(row("reference.block", "inf", {"L_hidden_states_": [2, 64, 8]}, "k")).name == (
        "trainer.block_forward[2x64]"
    )
    assert graph_request(row("actor.block", "bwd", {"L_hidden_states_": [2, 64, 8]}, "k")).kind == "block"
    assert graph_request(row("critic", "fwd", {"v": [1]}, "k")) is None
