"""The mixture schedule of data.streaming (data.schedule): the sources' weights as a function of tokens consumed,
in stages (a step change at a token count) and linear blends between two mixtures over a token range; and the
checks of it before launch (schedule_problems)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scaletrain.config import DataConfig, MixStage


def parse_position(text: str, run_tokens: int) -> int:
    """Tokens consumed at `text`: a count ("2e9", "500000") or a share of the run's tokens ("80%")."""
    text = text.strip().replace("_", "")
    if text.endswith("%"):
        share = float(text[:-1])
        if not 0 <= share <= 100:
            raise ValueError(f"{text!r} is not a share between 0% and 100%")
        return round(share / 100 * run_tokens)
    value = float(text)
    if value < 0 or value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens >= 0")
    return int(value)


@dataclass(frozen=True)
class _Segment:
    start: int  # tokens
    end: int  # tokens; == start: a step change
    weights: np.ndarray  # normalised, reached at `end`


class MixtureSchedule:
    """weights(tokens): the sources' normalised weights after `tokens` tokens. Before the first stage the sources'
    own weights; in [start, end) of a stage a straight line from the weights in force at start to the stage's."""

    def __init__(self, base: list[float], stages: list[MixStage], run_tokens: int):
        self.base = _normalised(base)
        self.segments = [
            _Segment(s, e, _normalised(st.weights))
            for st, (s, e) in zip(stages, (_span(st, run_tokens) for st in stages), strict=True)
        ]

    @classmethod
    def of(cls, data: DataConfig, run_tokens: int) -> MixtureSchedule:
        return cls([s.weight for s in data.sources] or [1.0], data.schedule, run_tokens)

    def weights(self, tokens: int) -> np.ndarray:
        w = self.base
        for seg in self.segments:
            if tokens >= seg.end:
                w = seg.weights
            elif tokens >= seg.start:
                a = (tokens - seg.start) / (seg.end - seg.start)
                return (1 - a) * w + a * seg.weights
            else:
                break
        return w


def _span(stage: MixStage, run_tokens: int) -> tuple[int, int]:
    start = parse_position(stage.start, run_tokens)
    return start, parse_position(stage.end, run_tokens) if stage.end else start


def _normalised(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def schedule_problems(data: DataConfig, run_tokens: int) -> list[str]:
    """What is wrong with data.schedule and the streaming weights, each with the fix; [] when it can run."""
    n = len(data.sources) or 1
    problems = []
    if data.schedule and not data.streaming:
        problems.append("data.schedule needs data.streaming = true (prepared shards mix by fixed weights)")
    if data.streaming and sum(max(0.0, s.weight) for s in data.sources) <= 0 and data.sources:
        first = data.schedule[0].start if data.schedule else None
        if first is None or _position_or_none(first, run_tokens) != 0:
            problems.append(
                "every data.sources[i].weight is 0, so the run would start on an empty mixture; give a source a "
                'weight, or start data.schedule\'s first stage at "0"'
            )
    previous_end = 0
    for j, st in enumerate(data.schedule):
        where = f"data.schedule[{j}]"
        if len(st.weights) != n:
            problems.append(f"{where}.weights has {len(st.weights)} value(s); give one per data source ({n})")
        elif any(w < 0 for w in st.weights) or sum(st.weights) <= 0:
            problems.append(
                f"{where}.weights {st.weights} must be >= 0 with a positive sum (never an empty mixture)"
            )
        try:
            start, end = _span(st, run_tokens)
        except ValueError as e:
            problems.append(f'{where}: {e}; write a token count ("2e9") or a share of the run ("80%")')
            continue
        if end < start:
            problems.append(f"{where}: end ({st.end}) comes before start ({st.start})")
        if start < previous_end:
            problems.append(
                f"{where} starts at {start:,} tokens, before the previous stage ends ({previous_end:,}); "
                "list the stages in order, without overlap"
            )
        previous_end = max(previous_end, end)
    return problems


def _position_or_none(text: str, run_tokens: int) -> int | None:
    try:
        return parse_position(text, run_tokens)
    except ValueError:
        return None
