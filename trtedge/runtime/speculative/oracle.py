"""A test proposer that knows the answer: it drafts the tokens the target emitted for the same prompt
in an earlier greedy run, so a greedy request accepts every draft and each verification step emits
``num_speculative_tokens + 1`` tokens. It measures the ceiling of the verify path (what a perfect
drafter would gain), for benchmarks and tests only: it is no ``--speculative-config`` method. Plug it
into an in-process engine that runs any proposer of the chain contract (``ngram`` is the cheapest)
with ``install``; ``settle`` makes its answer the speculative run's own (in bf16 a verify step may
round a near tie the other way than a plain step, and past that token the oracle drafts nothing)."""

from __future__ import annotations

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.speculative.tree import Draft


class OracleProposer:
    def __init__(self) -> None:
        self.answers: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the tokens emitted after them

    def remember(self, prompt_ids: list[int], token_ids: list[int]) -> None:
        """The target's greedy output for ``prompt_ids`` (a later run of the prompt drafts from it)."""
        self.answers[tuple(prompt_ids)] = list(token_ids)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft | None]:
        drafts: list[Draft | None] = []
        for seq, k in zip(seqs, limits):
            answer = self.answers.get(tuple(seq.token_ids[: seq.num_prompt_tokens]))
            made = seq.token_ids[seq.num_prompt_tokens :]
            # once the output parts from the remembered one, the oracle knows nothing more
            tokens = answer[len(made) : len(made) + k] if answer and answer[: len(made)] == made else []
            drafts.append(Draft.chain(tokens) if tokens else None)
        return drafts

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        pass

    def observe(self, seqs: list[Sequence], num_tokens: list[int], aux) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


def install(engine, proposer) -> None:
    """Make ``proposer`` draft for ``engine`` (an in-process ``Engine``, e.g. ``LLM(...,
    engine_process=False).engine``, started with a chain-drafting speculative config)."""
    spec = engine.speculative
    if spec is None or spec.config.is_tree:
        raise ValueError("install: the engine needs a speculative config with linear chains (e.g. ngram)")
    spec.proposer = proposer


def settle(llm, prompt_ids: list[int], params, oracle: OracleProposer, max_runs: int = 100) -> int:
    """Generate ``prompt_ids`` greedily with the oracle drafting until the output is the answer it
    drafted from (a fixed point: every later run accepts every draft). Each run learns its output, and
    a deterministic run agrees with the one before it past where that one parted from its answer, so
    the agreeing prefix grows every run. Returns the runs taken, or 0 when ``max_runs`` did not settle
    it or a run's agreement did not grow (the runs are not deterministic)."""
    kept = -1
    for runs in range(1, max_runs + 1):
        known = oracle.answers.get(tuple(prompt_ids)) or []
        out = llm.generate(prompt_ids, params)
        oracle.remember(prompt_ids, out.token_ids)
        if out.token_ids == known:
            return runs
        agreed = common_prefix(out.token_ids, known)
        if agreed <= kept:
            return 0
        kept = agreed
    return 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
