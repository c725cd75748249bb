"""The simulated vLLM's tokenizer and chat rendering. They live in router/sim_tokenizer.py, so
that the router counts text with the very same code (``kvtop route --tokenizer kvtop-sim``, the
route line ``kvtop sim`` prints); this module names them for the simulator."""

from router.sim_tokenizer import (IM_END, IM_START, VOCAB_SIZE, chatml_messages, count_tokens, filler_ids,
                                  filler_text, render_chat, render_messages, token_strs, tokenize)

__all__ = ["IM_END", "IM_START", "VOCAB_SIZE", "chatml_messages", "count_tokens", "filler_ids", "filler_text",
           "render_chat", "render_messages", "token_strs", "tokenize"]
