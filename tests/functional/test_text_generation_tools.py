"""The generation tools as users run them, on a tiny checkpoint trained by pretrain_gpt.py
(NullTokenizer, recorded in the checkpoint): tools/generate_text.py (flags, a prompts file,
the interactive prompt, the checkpoint resharded to another layout),
tools/run_text_generation_server.py answering real HTTP on 127.0.0.1 (400 with a reason for
each malformed request, staying up, concurrent requests kept apart) and
tools/text_generation_cli.py against it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tools.text_generation_cli import put

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTEXT = 48


def _env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(args, stdin=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], input=stdin, capture_output=True,
                          text=True, cwd=REPO, env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    result = _run(["pretrain_gpt.py", "--num-layers", 2, "--hidden-size", 32,
                   "--num-attention-heads", 4, "--seq-length", 32, "--max-position-embeddings",
                   CONTEXT, "--micro-batch-size", 2, "--train-iters", 2, "--lr", "1e-3",
                   "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 200,
                   "--eval-iters", 0, "--num-workers", 0, "--save", ckpt, "--save-interval", 2,
                   "--make-vocab-size-divisible-by", 8])
    assert result.returncode == 0, result.stderr[-3000:]
    return str(ckpt)


def _greedy(checkpoint, *extra, stdin=None):
    return _run(["tools/generate_text.py", "--load", checkpoint, "--top-k", 1,
                 "--max-new-tokens", 6, *extra], stdin=stdin)


def _samples(stdout: str) -> list[tuple[int, int, str, str]]:
    """generate_text.py's blocks: (index, count, prompt as printed, prompt + completion)."""
    from tools.generate_text import SAMPLE_BLOCK

    return [(int(i), int(n), prompt, text)
            for i, n, prompt, text in SAMPLE_BLOCK.findall(stdout)]


def _completions(stdout: str) -> list[str]:
    """The completed texts: the blocks' texts, or (interactive) the lines printed."""
    blocks = _samples(stdout)
    if blocks:
        return [text for *_, text in blocks]
    return [line for line in stdout.splitlines() if line]


def test_generate_text_from_flags_file_and_prompt(checkpoint, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("7 8 9\n\n10 11 12 13\n")
    result = _greedy(checkpoint, "--prompt", "1 2 3", "--prompts-file", prompts_file)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = _completions(result.stdout)
    assert len(lines) == 3
    prompts = ["1 2 3", "7 8 9", "10 11 12 13"]
    assert [(i, n, p) for i, n, p, _ in _samples(result.stdout)] == [
        (i, 3, repr(p)) for i, p in enumerate(prompts, 1)]
    assert result.stdout.count("=====") == 12  # nothing outside the blocks but their frames
    for line, prompt in zip(lines, ["1 2 3", "7 8 9", "10 11 12 13"]):
        assert line.startswith(prompt + " ") and len(line.split()) == len(prompt.split()) + 6
    # Megatron-DeepSpeed's spellings of --top-k 1 and --max-new-tokens, at the >> prompt.
    interactive = _run(["tools/generate_text.py", "--load", checkpoint, "--greedy",
                        "--out-seq-length", 6], stdin="7 8 9\n1 2 3\n")
    assert interactive.returncode == 0, interactive.stderr[-3000:]
    assert interactive.stdout.count(">> ") == 3
    assert _completions(interactive.stdout.replace(">> ", "\n")) == [lines[1], lines[0]]


def test_generate_text_from_a_checkpoint_saved_at_tensor_parallel_2(checkpoint, tmp_path):
    """The checkpoint resharded to tp 2 x pp 2 on disk generates in one process (merged and
    cut in memory) the greedy completion of the original."""
    from megatron.conversion import load_full_checkpoint
    from megatron.conversion.full import save_full_checkpoint

    tp2 = tmp_path / "tp2pp2"
    save_full_checkpoint(load_full_checkpoint(checkpoint, optimizer=False), str(tp2), 2, 2)
    original, resharded = (_greedy(c, "--prompt", "1 2 3") for c in (checkpoint, tp2))
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    assert _completions(resharded.stdout) == _completions(original.stdout)
    assert len(_completions(original.stdout)) == 1


def test_generate_text_refuses_bad_input(checkpoint, tmp_path):
    for extra, message in [(["--top-p", 1.5], "top_p must be between 0 and 1"),
                           (["--tensor-model-parallel-size", 2], "needs 2 processes; 1 were")]:
        result = _run(["tools/generate_text.py", "--load", checkpoint, "--prompt", "1",
                       *extra])
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    result = _run(["tools/generate_text.py", "--load", tmp_path, "--prompt", "1"])
    assert result.returncode == 2 and "holds no checkpoint" in result.stderr
    result = _run(["tools/generate_text.py", "--load", checkpoint, "--prompt", "3 4 5000"])
    assert result.returncode == 1 and "id 5000 is outside" in result.stderr


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = subprocess.Popen([sys.executable, "tools/run_text_generation_server.py", "--load",
                             checkpoint, "--port", "0", "--max-prompts", "4",
                             "--max-tokens-to-generate", "16"], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    url, seen, deadline = None, [], time.time() + 120
    while url is None and time.time() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith("serving on http://127.0.0.1:"):
            url = line.split()[-1]
    assert url is not None, "".join(seen)[-3000:]
    yield url, proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


MALFORMED = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (json.dumps({"tokens_to_generate": 4}).encode(), "prompts argument required"),
    (json.dumps({"prompts": "1 2"}).encode(), "not a list of strings"),
    (json.dumps({"prompts": [1, 2]}).encode(), "not a list of strings"),
    (json.dumps({"prompts": []}).encode(), "prompts is empty"),
    (json.dumps({"prompts": ["1"] * 5}).encode(), "Maximum number of prompts is 4"),
    (json.dumps({"prompts": ["1"], "tokens_to_generate": "4"}).encode(), "tokens_to_generate"),
    (json.dumps({"prompts": ["1"], "tokens_to_generate": 17}).encode(), "between 0 and 16"),
    (json.dumps({"prompts": ["1"], "tokens_to_generate": -1}).encode(), "between 0 and 16"),
    (json.dumps({"prompts": ["1"], "tokens_to_generate": 0}).encode(),
     "tokens_to_generate=0 implies logprobs should be True"),
    (json.dumps({"prompts": [" ".join(["5"] * 49)], "tokens_to_generate": 0,
                 "logprobs": True}).encode(), "exceeds the model's context of 48"),
    (json.dumps({"prompts": ["1"], "tokens_to_generate": True}).encode(), "tokens_to_generate"),
    (json.dumps({"prompts": ["1"], "temperature": 0}).encode(), "temperature"),
    (json.dumps({"prompts": ["1"], "top_k": -1}).encode(), "top_k"),
    (json.dumps({"prompts": ["1"], "top_p": 1.5}).encode(), "top_p"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # RecursionError in json
    (b'{"prompts": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", "nested too deeply"),
    (json.dumps({"prompts": ["1"], "logprobs": "yes"}).encode(), "logprobs"),
    (json.dumps({"prompts": ["1"], "random_seed": -5}).encode(), "random_seed"),
    # Past a 64-bit seed: was HTTP 500 ("Overflow when unpacking long long").
    (json.dumps({"prompts": ["1"], "random_seed": 2**64}).encode(),
     "random_seed must be an integer from 0 to 2^64-1"),
    (json.dumps({"prompts": ["1"], "random_seed": 10**30}).encode(), "random_seed"),
    (json.dumps({"prompts": ["1"], "beam_width": 4}).encode(), "not supported"),
    (json.dumps({"prompts": ["1"], "tokens": 4}).encode(), "unknown field"),
    (json.dumps({"prompts": [" ".join(["5"] * 40)], "tokens_to_generate": 16}).encode(),
     "exceeds the model's context of 48"),
    (json.dumps({"prompts": ["5 900"]}).encode(), "prompt 0 cannot be tokenized"),
]


def _raw_put(url: str, data: bytes) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=data, method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_server_answers_and_refuses_malformed_requests(server, checkpoint):
    url, proc = server
    good = {"prompts": ["1 2 3", "7 8 9"], "tokens_to_generate": 6, "top_k": 1,
            "logprobs": True}
    status, body = put(url, good)
    assert status == 200, body
    reply = json.loads(body)
    expected = _completions(_greedy(checkpoint, "--prompt", "1 2 3", "--prompt", "7 8 9").stdout)
    assert reply["text"] == expected  # the server and generate_text.py agree
    # Megatron's layout: every token of the sequence, and the log-probability of each
    # token from the second on (the prompt's, then the new ones).
    assert [s[:3] for s in reply["segments"]] == [["1", "2", "3"], ["7", "8", "9"]]
    assert [" ".join(s) for s in reply["segments"]] == expected
    assert all(len(lp) == 8 and all(v <= 0 for v in lp) for lp in reply["logprobs"])
    _check_scoring(url, good["prompts"], reply["logprobs"])
    for data, reason in MALFORMED:
        status, refusal = _raw_put(url, data)
        assert status == 400 and reason in refusal, (data, status, refusal)
        assert proc.poll() is None
    status, refusal = _raw_put(url, b'{"prompts": ["' + b"1 " * (2 << 20) + b'"]}')  # 4 MiB
    assert status == 413 and "larger than 4194304 bytes" in refusal, (status, refusal)
    assert put(url, good) == (200, body)  # still up, and the same reply
    assert urllib_get(url) == 405
    # top-k then top-p (as Hugging Face), where Megatron refuses both: sampled, seeded.
    nucleus = {"prompts": ["1 2 3"], "tokens_to_generate": 6, "top_k": 40, "top_p": 0.95,
               "temperature": 0.75, "random_seed": 5}
    status, sampled = put(url, nucleus)
    assert status == 200 and put(url, nucleus) == (200, sampled), sampled
    largest = {**nucleus, "random_seed": 2**64 - 1}  # the largest 64-bit seed is taken
    assert put(url, largest)[0] == 200


def _check_scoring(url: str, prompts: list, generation_logprobs: list) -> None:
    """tokens_to_generate 0 with logprobs scores the prompts: nothing generated, and the
    prompts' log-probabilities are those the generation reply began with. Without logprobs,
    the reply's logprobs is null (as Megatron's)."""
    status, body = put(url, {"prompts": prompts, "tokens_to_generate": 0, "logprobs": True})
    assert status == 200, body
    scored = json.loads(body)
    assert scored["text"] == prompts
    assert [" ".join(s) for s in scored["segments"]] == prompts
    for got, whole in zip(scored["logprobs"], generation_logprobs):
        assert len(got) == 2 and all(abs(a - b) < 1e-5 for a, b in zip(got, whole[:2])), got
    full = " ".join(["5"] * 48)  # a prompt filling the context may be scored
    status, body = put(url, {"prompts": [full], "tokens_to_generate": 0, "logprobs": True})
    assert status == 200 and len(json.loads(body)["logprobs"][0]) == 47, body
    status, body = put(url, {"prompts": prompts, "tokens_to_generate": 2, "top_k": 1})
    assert status == 200 and json.loads(body)["logprobs"] is None, body


def urllib_get(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def test_concurrent_requests_get_their_own_replies(server):
    url, _ = server
    requests = [{"prompts": [f"{i} {i + 1}"], "tokens_to_generate": 4 + i % 3, "top_k": 1}
                for i in range(1, 7)]
    alone = [json.loads(put(url, r)[1])["text"] for r in requests]
    together: list = [None] * len(requests)

    def send(i):
        together[i] = json.loads(put(url, requests[i])[1])["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_cli_client_against_the_server(server):
    url, _ = server
    address = url.removeprefix("http://").removesuffix("/api")
    result = _run(["tools/text_generation_cli.py", address, "--prompt", "4 5",
                   "--tokens-to-generate", 3, "--top-k", 1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("4 5 ")
    asked = _run(["tools/text_generation_cli.py", address, "--top-k", 1],
                 stdin="4 5\nthree\n3\n")
    assert asked.returncode == 0, asked.stderr
    assert "a whole number, please" in asked.stdout
    assert result.stdout.splitlines()[-1] in asked.stdout.splitlines()
    refused = _run(["tools/text_generation_cli.py", address, "--prompt", "4",
                    "--tokens-to-generate", 99])
    assert refused.returncode == 1 and "Error 400" in refused.stderr


def _wait_for_url(proc: subprocess.Popen, lines: list, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving on http://127.0.0.1:"):
            return line.split()[-1]
    raise AssertionError("".join(lines)[-3000:])


@pytest.mark.slow
def test_two_rank_server_stops_quietly_on_sigterm(checkpoint):
    """Two ranks started as a launcher starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT: tensor
    parallel 2), a request served by both, then SIGTERM to every rank (what torchrun, srun
    and scancel send): both exit 0 and print no traceback; rank 1 leaves when rank 0
    releases it, not mid-collective (no gloo "Connection reset by peer")."""
    from tests.dist_utils import free_port

    env = {**_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "tools/run_text_generation_server.py", "--load",
                               checkpoint, "--port", "0"], cwd=REPO, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        url = _wait_for_url(procs[0], seen := [])
        status, body = put(url, {"prompts": ["1 2 3"], "tokens_to_generate": 4, "top_k": 1})
        assert status == 200, body
        assert json.loads(body)["text"] == _completions(_greedy(
            checkpoint, "--prompt", "1 2 3", "--max-new-tokens", 4).stdout)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    outputs[0] = "".join(seen) + outputs[0]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, (rank, out[-3000:])
        assert "Traceback" not in out and "Connection reset" not in out, (rank, out[-3000:])


def test_generate_text_from_a_hugging_face_folder(tmp_path):
    """--hf-model: a local GPT-2 folder converted in memory; greedy output is HF's."""
    import torch

    from tests.unit.text_generation.hf_utils import tiny_hf_model

    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path / "gpt2")
    result = _run(["tools/generate_text.py", "--hf-model", tmp_path / "gpt2", "--top-k", 1,
                   "--max-new-tokens", 7, "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", 299, "--ignore-eod", "--prompt", "11 12 13"])
    assert result.returncode == 0, result.stderr[-3000:]
    hf.generation_config.eos_token_id = None  # as --ignore-eod
    expected = hf.generate(torch.tensor([[11, 12, 13]]), max_new_tokens=7, do_sample=False,
                           pad_token_id=0)[0].tolist()
    assert _completions(result.stdout) == [" ".join(map(str, expected))]
    no_tokenizer = _run(["tools/generate_text.py", "--hf-model", tmp_path / "gpt2",
                         "--prompt", "1"])
    assert no_tokenizer.returncode == 2 and "holds no tokenizer" in no_tokenizer.stderr
