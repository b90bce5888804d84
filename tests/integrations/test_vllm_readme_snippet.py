"""The "Run your piece in vLLM" snippet, executed as written.

The snippet's Python block (README.md's section when the README has it, else
servelab/integrations/vllm/README_SNIPPET.md, which the README section is copied from) runs with a
stand-in ``LLM`` that records its arguments (vllm.LLM needs a GPU); then vLLM's real scheduler is
built with the scheduler class it produced and vLLM's logits-processor loader builds the processor
class. Skipped without vLLM.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Run your piece in vLLM"


def snippet_source() -> str:
    readme = (ROOT / "README.md").read_text()
    text = readme[readme.index(SECTION):] if SECTION in readme else \
        (ROOT / "servelab/integrations/vllm/README_SNIPPET.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


class MyProc:
    """A processor a user would write: bans token 0."""

    argmax_invariant = False

    def apply(self, logits, metadata):
        return logits.index_fill(1, torch.tensor([0]), float("-inf"))


def test_the_snippet_runs_and_its_classes_work_in_vllm():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.sample.logits_processor import LogitsProcessor, build_logitsprocs

    from servelab.integrations.vllm.harness import build_scheduler, make_request, model_output

    calls = []
    namespace = {"LLM": lambda model, **kwargs: calls.append(kwargs), "model": "some-model", "MyProc": MyProc}
    source = snippet_source()
    assert source.count("\n") == 3, "the recipe is three lines"
    exec(compile(source, "README snippet", "exec"), namespace)
    scheduler_cls = calls[0]["scheduler_cls"]
    (processor_cls,) = calls[1]["logits_processors"]
    assert issubclass(scheduler_cls, Scheduler) and issubclass(processor_cls, LogitsProcessor)

    sched = build_scheduler(scheduler_cls, max_num_seqs=1)
    for i, n in enumerate((30, 5, 12)):
        sched.add_request(make_request(f"s{i}", [100 + i] * n, 2))
    admitted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        admitted += [r.req_id for r in out.scheduled_new_reqs]
        sched.update_from_output(out, model_output(sched, out))
    assert admitted == ["s1", "s2", "s0"], "sjf: shortest prompt first"
    procs = build_logitsprocs(sched.vllm_config, torch.device("cpu"), False, False,
                              custom_logitsprocs=[processor_cls])
    assert any(isinstance(p, processor_cls) for p in procs.non_argmax_invariant)
