"""`deltaserve bench spec`: the side-by-side A/B runs end to end on a tiny checkpoint; its workloads are
deterministic and are what they claim to be."""

from __future__ import annotations

import ast
import io
import json
import tokenize

import pytest

from deltaserve.bench.spec import SpecBenchArgs, acceptance, parse_batch_sizes, run
from deltaserve.bench.spec import SpecCounters as C
from deltaserve.bench.spec_metrics import parse_accepted_per_pos, per_position_rates, spec_decode_section
from deltaserve.bench.spec_workloads import build_workload, code_edits
from deltaserve.default_model import default_model_dir
from deltaserve.entrypoints.cli import main
from deltaserve.text.tokenizer import Tokenizer

NGRAM = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(str(default_model_dir()))


def test_ab_runs_end_to_end_on_a_tiny_checkpoint(tiny_dir, tmp_path):
    """Both engines run every batch size in alternating rounds; the result has both throughputs, their ratio, the
    per-round ratios, the acceptance counters and the decode-step view; greedy outputs are identical."""
    out = tmp_path / "spec.json"
    result = run(SpecBenchArgs(model=str(tiny_dir("base")), speculative_config=NGRAM, workload="random",
                               batch_sizes="1,3", rounds=2, min_prompts=2, output_len=12, num_threads=1,
                               cache_memory="64MiB", result_file=str(out)))
    assert [r["batch_size"] for r in result["batch_sizes"]] == [1, 3]
    for res in result["batch_sizes"]:
        assert res["baseline_output_throughput"] > 0 and res["speculative_output_throughput"] > 0
        assert res["ratio"] == pytest.approx(res["speculative_output_throughput"] / res["baseline_output_throughput"])
        assert len(res["round_ratios"]) == 2
        assert res["greedy_mismatches"] == 0
        for side in ("baseline", "speculative"):
            runs = res["runs"][side]
            assert len(runs) == 2
            # random prompts ignore eos: every request generates exactly output_len tokens
            assert all(r["output_tokens"] == 12 * res["num_prompts"] for r in runs)
            assert all(r["decode_steps"] > 0 for r in runs)
        acc = res["acceptance"]
        assert acc["num_drafts"] > 0  # a random tiny model loops, so prompt lookup with n = 1 finds matches
        assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
        assert len(acc["acceptance_per_pos"]) <= 2
        assert acc["accepted_per_pos"] == sorted(acc["accepted_per_pos"], reverse=True)
        # plain decoding gains one token per sequence and step; speculation at least one
        assert res["runs"]["baseline"][0]["tokens_per_sequence_step"] == pytest.approx(1.0)
        assert res["runs"]["speculative"][0]["tokens_per_sequence_step"] >= 1.0
    assert json.loads(out.read_text())["batch_sizes"][0]["acceptance"] == result["batch_sizes"][0]["acceptance"]


def test_cli_prints_both_throughputs_ratio_and_acceptance(tiny_dir, capsys):
    rc = main(["--log-level", "WARNING", "bench", "spec", "--model", str(tiny_dir("base")), "--speculative-config",
               NGRAM, "--workload", "random", "--batch-sizes", "2", "--rounds", "1", "--min-prompts", "2",
               "--output-len", "6", "--num-threads", "1", "--cache-memory", "64MiB"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "batch 2 (2 prompts, 1 rounds): baseline" in text
    assert "tok/s, speculative" in text and "ratio" in text
    assert "acceptance: mean length" in text and "per position" in text


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(ValueError, match="--batch-sizes"):
        parse_batch_sizes("1,x")
    with pytest.raises(ValueError, match="--batch-sizes"):
        parse_batch_sizes("0")
    with pytest.raises(ValueError, match="--workload"):
        SpecBenchArgs(workload="poems")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecBenchArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}')
    assert main(["bench", "spec", "--workload", "poems"]) == 2
    assert "--workload must be one of" in capsys.readouterr().err


def test_acceptance_is_computed_over_the_counter_difference():
    acc = acceptance(C(2, 6, 3, (2, 1)), C(6, 18, 11, (5, 4, 3)))
    assert acc["num_drafts"] == 4 and acc["num_draft_tokens"] == 12 and acc["num_accepted_tokens"] == 8
    assert acc["mean_acceptance_length"] == 3.0
    assert acc["accepted_per_pos"] == [3, 3, 3]
    assert acc["acceptance_per_pos"] == [0.75, 0.75, 0.75]
    assert acceptance(C(1, 1, 1, (1,)), C(1, 1, 1, (1,)))["mean_acceptance_length"] == 1.0


@pytest.mark.parametrize("name", ["code-edit", "tool-chat", "random"])
def test_workloads_are_deterministic(name, embedded_tokenizer):
    model = str(default_model_dir())
    a = build_workload(name, embedded_tokenizer, model, 6, seed=3)
    b = build_workload(name, embedded_tokenizer, model, 6, seed=3)
    c = build_workload(name, embedded_tokenizer, model, 6, seed=4)
    assert a == b
    assert a.prompts != c.prompts
    assert len(a.prompts) == 6 and all(a.prompts)
    assert a.ignore_eos is (name == "random")


def test_code_edit_prompt_asks_for_a_rename_that_copies_the_function():
    for edit in code_edits(5, seed=0):
        ast.parse(edit.code)  # a whole function of the standard library
        ast.parse(edit.rewritten)
        names = [t.string for t in tokenize.generate_tokens(io.StringIO(edit.rewritten).readline)
                 if t.type == tokenize.NAME]
        assert edit.old not in names and names.count(edit.new) >= 3
        assert edit.prompt_text.startswith(edit.code)
        assert f"`{edit.old}` renamed to `{edit.new}`" in edit.prompt_text
        assert edit.prompt_text.endswith(edit.rewritten.splitlines(keepends=True)[0])
        # apart from the rename, the expected output is the prompt's function
        assert edit.rewritten.replace(edit.new, edit.old) == edit.code or edit.new in edit.code


def test_tool_chat_prompts_are_rendered_chats_with_the_five_tools(embedded_tokenizer):
    w = build_workload("tool-chat", embedded_tokenizer, str(default_model_dir()), 4, seed=0)
    texts = [embedded_tokenizer.decode(p) for p in w.prompts]
    for i, text in enumerate(texts):
        assert text.startswith("<|im_system|>tool_declare")
        for tool in ("calculator", "get_weather", "convert_units", "search_files", "get_time"):
            assert f'"name":"{tool}"' in text
        assert text.endswith("<|im_assistant|>assistant<|im_middle|>" + ("<think>" if i == 2 else ""))
        assert ("## Return of functions." in text) == (i % 2 == 1)
    assert [s.split()[1] for s in w.sources] == ["call", "answer", "call", "answer"]


def test_random_prompts_use_ordinary_ids_only(embedded_tokenizer):
    w = build_workload("random", embedded_tokenizer, str(default_model_dir()), 3, seed=0)
    special = set(embedded_tokenizer.special_tokens.values())
    assert all(len(p) == 128 and not special & set(p) for p in w.prompts)


METRICS_TEXT = """# HELP deltaserve:spec_decode_num_accepted_tokens_per_pos_total Accepted proposed tokens by position.
deltaserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 7.0
deltaserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 3.0
deltaserve:spec_decode_num_accepted_tokens_per_pos_created{model_name="tiny",position="0"} 1.7e9
deltaserve:spec_decode_num_drafts_total{model_name="tiny"} 10.0
"""


def test_per_position_acceptance_from_metrics_text():
    after = parse_accepted_per_pos(METRICS_TEXT)
    assert after == {0: 7.0, 1: 3.0}
    assert per_position_rates({0: 1.0}, after, drafts=4) == [1.5, 0.75]
    assert per_position_rates({}, after, drafts=0) == []


def test_spec_decode_section_only_when_drafts_were_verified():
    assert spec_decode_section({"spec_decode_num_drafts": 0}) == ""
    text = spec_decode_section({"spec_decode_num_drafts": 4, "spec_decode_acceptance_rate": 50.0,
                                "spec_decode_acceptance_length": 2.0, "spec_decode_draft_tokens": 8,
                                "spec_decode_accepted_tokens": 4,
                                "spec_decode_per_position_acceptance_rates": [0.75, 0.25]})
    assert "Speculative Decoding" in text and "Acceptance length:" in text and "2.00" in text
    assert "Position 0:" in text and "75.00" in text and "Position 1:" in text


@pytest.mark.slow  # CI time
def test_bench_serve_reports_acceptance_of_a_speculative_server(tiny_dir, tmp_path, capsys):
    """Against `deltaserve serve --speculative-config` (n-gram), `bench serve` reports the acceptance length,
    rate and per-position acceptance of its own run (from /metrics before and after) in the JSON and the table."""
    from tests.entrypoints.server_fixture import API_KEY, start_server, stop_server

    server = start_server(tiny_dir("base"), tmp_path, "--speculative-config", NGRAM)
    try:
        rc = main(["--log-level", "WARNING", "bench", "serve", "--base-url", server.url, "--model",
                   str(tiny_dir("base")), "--header", f"Authorization=Bearer {API_KEY}", "--disable-tqdm",
                   "--num-prompts", "3", "--random-input-len", "48", "--random-output-len", "24",
                   "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    finally:
        stop_server(server)
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    drafts = result["spec_decode_num_drafts"]
    assert drafts > 0
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + result["spec_decode_accepted_tokens"] / drafts)
    rates = result["spec_decode_per_position_acceptance_rates"]
    assert 1 <= len(rates) <= 2 and rates == sorted(rates, reverse=True)
    assert sum(rates) * drafts == pytest.approx(result["spec_decode_accepted_tokens"])
    assert "Speculative Decoding" in capsys.readouterr().out
