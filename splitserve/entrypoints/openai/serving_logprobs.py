"""Logprobs in the API's shapes: completions' (token texts, offsets, top dicts; the prompt's tokens
first with echo), chat's (content entries with bytes and top lists), and vLLM's prompt_logprobs
({token_id: {logprob, rank, decoded_token}} per prompt token, None for the first).

`token_text` is the server's cached single-token decode. The engine's dicts hold the scored token
first (sampled, or the prompt's own), then the top k.
"""
from __future__ import annotations

from typing import Callable

from splitserve.entrypoints.openai.protocol import (ChatChoiceLogprobs, CompletionLogprobs, PromptLogprob,
                                                    PromptLogprobs, TokenLogprob, TopLogprob)

TokenText = Callable[[int], str]


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float]],
                        offset: int, out: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Per token: its text, its logprob, and the top candidates (the scored one always among them,
    as vLLM does), appended to `out` when given."""
    out = out if out is not None else CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        text = token_text(tid)
        out.tokens.append(text)
        out.token_logprobs.append(entry.get(tid))
        out.top_logprobs.append({token_text(t): lp for t, lp in entry.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echo_logprobs(token_text: TokenText, prompt_ids: list[int],
                  prompt_logprobs: list[dict[int, float] | None] | None) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs: its first token has none (null)."""
    out = CompletionLogprobs()
    if not prompt_ids:
        return out
    text = token_text(prompt_ids[0])
    out.tokens.append(text)
    out.token_logprobs.append(None)
    out.top_logprobs.append(None)
    out.text_offset.append(0)
    return completion_logprobs(token_text, prompt_ids[1:], list((prompt_logprobs or [None])[1:]), len(text), out)


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float]],
                  k: int) -> ChatChoiceLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        text = token_text(tid)
        # Sorting recovers exactly the top k: a sampled token outside them ranks below all k.
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append(TokenLogprob(
            token=text, logprob=entry.get(tid, float("-inf")), bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode()))
                          for t, lp in top]))
    return ChatChoiceLogprobs(content=content)


def prompt_logprobs_out(token_text: TokenText, prompt_logprobs) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: None first, then {token_id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=lp, rank=getattr(lp, "rank", None), decoded_token=token_text(t))
             for t, lp in entry.items()} for entry in prompt_logprobs]
