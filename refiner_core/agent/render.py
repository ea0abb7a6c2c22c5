"""A written conversation as the agent loop's own tokens: what SFT trains on for tool-using conversations.

The loop never renders a whole conversation with the chat template. It renders the prompt once (render_prompt),
keeps each assistant turn as its own tokens (sampled, or a written turn tokenized once plus the end-of-turn
token: assistant_turn_ids), and between turns tokenizes only the template's framing of the messages that follow
(following_ids, tool results as plain text). A template that renders a whole conversation otherwise (one that
drops earlier turns' reasoning, or a tokenizer that merges tokens across a turn boundary) would teach other
tokens than the ones the policy continues from at rollout; `loop_tokens` builds a conversation exactly as the
loop does, so a conversation the loop produced comes back as the same token ids.
"""

from __future__ import annotations

from refiner_core.agent.loop import AgentRollout, assistant_turn_ids, end_of_turn_id, following_ids
from refiner_core.data.prompts import render_prompt
from refiner_core.rollout.base import stop_token_ids


def loop_tokens(tokenizer, messages: list[dict], eos: set[int] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of the conversation as the agent loop builds them, and per token whether the assistant wrote it
    (the loss mask: assistant text and its end-of-turn token). `eos`: the engine's end-of-sequence ids (default
    those an engine stops at for this tokenizer: its EOS and the template's end of turn). Messages after the last
    assistant turn carry nothing to learn and are left out; two assistant turns in a row are framed as the
    template frames them (its end of turn and the next turn's header, not trained)."""
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("the conversation has no assistant turn")
    eos = eos or stop_token_ids(tokenizer, [])
    _, ids = render_prompt(tokenizer, messages[: assistant[0]])
    mask = [False] * len(ids)
    end = end_of_turn_id(tokenizer, eos)
    for before, k in zip([None, *assistant], assistant):
        if before is not None:  # the template's framing of the messages between two assistant turns, if any
            framing = following_ids(tokenizer, messages[before + 1 : k])
            if ids[-1] in eos and framing and framing[0] == ids[-1]:
                framing = framing[1:]  # the turn already ended with the template's end-of-turn token, as in the loop
            ids += framing
            mask += [False] * len(framing)
        turn = assistant_turn_ids(tokenizer, messages[k]["content"], end)
        ids += turn
        mask += [True] * len(turn)
    return ids, mask


def rollout_messages(prompt: list[dict], rollout: AgentRollout) -> list[dict]:
    """The conversation a loop rollout holds, as chat messages after its prompt's: each assistant turn's text
    and each tool result that was appended (one `tool` message per call)."""
    messages = list(prompt)
    for t in rollout.turns:
        if t.role == "assistant":
            messages.append({"role": "assistant", "content": t.text})
        elif t.token_end > t.token_start:
            messages.append({"role": "tool", "content": t.text})
    return messages
