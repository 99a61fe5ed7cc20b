"""One torchtitan training job, launched as a user launches it: torchrun on torchtitan's
own entry point (`-m torchtitan.train`), the config from the test's registry module
(titan_train_registry.py), spikeguard's settings as torchtitan command-line options.

Also makes what the job reads: a byte-level tokenizer (256 tokens, the model's
vocabulary; no special tokens) and a small json corpus, in the caller's directory.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
JOB_TIMEOUT_S = 240   # a hung collective fails here, not at the group's own timeout
WORDS = ("the router sends each token to k experts and the load of an expert "
         "moves from step to step while the budget stays where it is").split()


def make_assets(root: Path) -> tuple[Path, Path]:
    """(tokenizer dir, corpus dir) under `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok_dir, corpus_dir = root / "tokenizer", root / "corpus"
    tok_dir.mkdir(parents=True, exist_ok=True)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tok_dir / "tokenizer.json"))
    gen = random.Random(0)
    with open(corpus_dir / "data.json", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(gen.choice(WORDS) for _ in range(80))}) + "\n")
    return tok_dir, corpus_dir


@dataclass
class Job:
    returncode: int
    output: str
    reports: list = field(default_factory=list)   # per rank: titan_train_registry's meter

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]

    @property
    def steps_logged(self) -> int:
        """Steps torchtitan logged on rank 0 (its metrics line, log_freq 1)."""
        return len(re.findall(r"step:\s+\d+\s", _plain(self.output))) // max(1, self.nproc)

    nproc: int = 1

    def metrics(self) -> list[str]:
        """torchtitan's per-step loss and grad norm, as rank 0 logged them."""
        return re.findall(r"(step:\s+\d+\s+loss:\s+\S+\s+grad_norm:\s+\S+)", _plain(self.output))

    def peak(self, rank: int = 0, steps=None) -> int:
        peaks = self.reports[rank]["peaks"]
        return max(peaks if steps is None else [peaks[i] for i in steps])


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(assets: tuple[Path, Path], work: Path, *options: str, nproc: int = 1,
            config: str = "tiny_deepseek_guarded", spike_every: int = 0,
            backward_oom_at: int = -1, timeout_s: int = JOB_TIMEOUT_S) -> Job:
    """torchrun -m torchtitan.train with the registry's `config` and `options`."""
    tok_dir, corpus_dir = assets
    work.mkdir(parents=True, exist_ok=True)
    report = work / "meter"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]),
               SPIKEGUARD_TEST_REPORT=str(report), OMP_NUM_THREADS="1",
               SPIKEGUARD_TEST_SPIKE_EVERY=str(spike_every),
               SPIKEGUARD_TEST_BACKWARD_OOM_AT=str(backward_oom_at))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "torchtitan.train", "--module", "titan_train_registry", "--config", config,
           "--hf_assets_path", str(tok_dir), "--dataloader.dataset_path", str(corpus_dir),
           "--dump_folder", str(work / "out"), *options]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=work)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchtitan.train {options} did not finish in {timeout_s} s "
                             f"(hang)") from None
    reports = [json.loads(p.read_text()) for p in sorted(work.glob("meter.*.json"))]
    return Job(done.returncode, done.stdout + done.stderr, reports, nproc)


EP2 = ("--parallelism.expert_parallel_degree", "2",
       "--parallelism.spmd_backend", "partial_dtensor")
