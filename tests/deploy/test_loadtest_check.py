"""``--check``: a fake that drops / duplicates / corrupts a token under load is caught, exactly.

The oracle is the fake server's own log of the responses it corrupted (a response is corrupted when its
third token is produced while two or more requests are in flight; the sequential reference run never
has two in flight).
"""

import json

import pytest
from helpers.fake_openai_server import FakeBehavior, FakeOpenAIServer, expected_pieces
from pagedray.deploy.loadtest import main
from pagedray.deploy.loadtest.check import (
    CAUSE_CORRUPTED,
    CAUSE_DUPLICATED,
    CAUSE_LOST,
    ReferenceOutput,
    classify_mismatch,
    load_reference,
    save_reference,
)

PROMPTS = [f"prompt number {i} about a river" for i in range(8)]
TOKENS = 6


def write_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": TOKENS}) + "\n" for p in PROMPTS))
    return path


def run_main(server, tmp_path, *extra):
    out = tmp_path / "report.json"
    rc = main(["--url", server.url, "--model", "fake", "--prompts-file", str(write_prompts(tmp_path)),
               "--num-requests", "8", "--out", str(out), "--no-plots", "--no-progress", "--no-metrics",
               *extra])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("corruption, cause", [("drop", CAUSE_LOST), ("duplicate", CAUSE_DUPLICATED),
                                               ("replace", CAUSE_CORRUPTED)])
def test_check_catches_exactly_the_responses_corrupted_under_load(tmp_path, corruption, cause):
    behavior = FakeBehavior(first_token_delay_s=0.05, inter_token_delay_s=0.02, corrupt_min_in_flight=2,
                            corrupt_at=2, corruption=corruption)
    with FakeOpenAIServer(behavior) as server:
        rc, report = run_main(server, tmp_path, "--check", "--concurrency", "4")
        corrupted = list(server.corrupted)
    assert corrupted, "the fake never saw 4 requests in flight; the load did not happen"
    run = report["runs"][0]
    failed = [r for r in run["requests"] if r["error"] is not None]
    assert sorted(PROMPTS[r["prompt_index"]] for r in failed) == sorted(corrupted)
    assert all(r["error"] == cause and "at piece 2" in r["error_detail"] for r in failed)
    assert run["check"]["checked"] == 8 and run["check"]["mismatched"] == len(corrupted)
    assert run["summary"]["failed_by_cause"] == {cause: len(corrupted)}
    assert rc == 1


def test_check_passes_a_clean_server_under_load(tmp_path):
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.02, inter_token_delay_s=0.01)) as server:
        rc, report = run_main(server, tmp_path, "--check", "--concurrency", "4")
    assert rc == 0
    assert report["runs"][0]["check"] == {"checked": 8, "mismatched": 0, "unchecked": 0, "examples": []}


def test_check_against_a_reference_file(tmp_path):
    reference = {(p, TOKENS): ReferenceOutput("".join(expected_pieces(p, TOKENS)), tuple(expected_pieces(p, TOKENS)))
                 for p in PROMPTS[1:]}  # PROMPTS[0] has no reference: unchecked
    wrong = list(expected_pieces(PROMPTS[3], TOKENS))
    wrong[4] = " zulu"
    reference[(PROMPTS[3], TOKENS)] = ReferenceOutput("".join(wrong), tuple(wrong))
    path = tmp_path / "reference.json"
    save_reference(path, reference)
    assert load_reference(path) == reference
    with FakeOpenAIServer(FakeBehavior()) as server:
        rc, report = run_main(server, tmp_path, "--check", "--reference", str(path), "--rate", "inf")
        assert server.arrivals == 8  # no reference run was made
    check = report["runs"][0]["check"]
    assert (check["checked"], check["mismatched"], check["unchecked"]) == (7, 1, 1)
    assert check["examples"][0]["prompt_index"] == 3 and check["examples"][0]["cause"] == CAUSE_CORRUPTED
    assert rc == 1


def test_save_reference_from_the_reference_run(tmp_path):
    path = tmp_path / "saved.json"
    with FakeOpenAIServer(FakeBehavior()) as server:
        rc, _ = run_main(server, tmp_path, "--check", "--save-reference", str(path), "--concurrency", "2")
    saved = load_reference(path)
    assert rc == 0
    assert saved == {(p, TOKENS): ReferenceOutput("".join(expected_pieces(p, TOKENS)),
                                                  tuple(expected_pieces(p, TOKENS))) for p in PROMPTS}


@pytest.mark.parametrize("got, cause", [
    (["a", "b", "d"], CAUSE_LOST),
    (["a", "b", "c"], CAUSE_LOST),
    (["a", "b", "b", "c", "d"], CAUSE_DUPLICATED),
    (["a", "a", "b", "c", "d"], CAUSE_DUPLICATED),
    (["a", "x", "c", "d"], CAUSE_CORRUPTED),
    (["a", "b", "x", "c", "d"], CAUSE_CORRUPTED),
])
def test_classify_mismatch(got, cause):
    assert classify_mismatch(["a", "b", "c", "d"], got)[0] == cause


def test_classify_mismatch_rejects_equal_lists():
    with pytest.raises(ValueError, match="expected/got"):
        classify_mismatch(["a"], ["a"])


def test_load_reference_rejects_bad_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"outputs": [{"prompt": "p", "max_tokens": 2, "text": "ab", "chunks": ["a"]}]}))
    with pytest.raises(ValueError, match="reference: outputs\\[0\\] 'chunks'"):
        load_reference(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="reference:"):
        load_reference(path)
