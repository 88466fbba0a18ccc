"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's
shapes. lm-evaluation-harness's ``local-completions`` finds them and then needs no tokenizer of its
own (its "remote" tokenizer backend)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from pydantic import Field
from starlette.responses import JSONResponse, Response

from trtedge.server.chat_prompt import prepare_prompt
from trtedge.server.core import ServingCore
from trtedge.server.errors import bad_request
from trtedge.server.openai.protocol import ChatCompletionRequest, ChatMessage, TokenId, _Model


class TokenizeRequest(_Model):
    """A text ``prompt`` or a chat (``messages``, rendered through the chat template): exactly one."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # unset: true for a prompt (BOS where the model wants it), false for messages (the template adds it)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]


class TokenizationServing:
    def __init__(self, core: ServingCore):
        self.core = core
        self.llm = core.llm

    async def tokenize(self, req: TokenizeRequest) -> Response:
        self.core.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")
        llm = self.llm
        if req.prompt is not None:
            special = req.add_special_tokens is not False
            ids = await asyncio.to_thread(llm.tokenize, req.prompt, add_special_tokens=special)
        else:
            chat = ChatCompletionRequest(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            ids = list((await prepare_prompt(self.core, chat)).ids)
            bos = self.core.tokenizer_info.bos_token_id
            if req.add_special_tokens and bos is not None and ids[:1] != [bos]:
                ids.insert(0, bos)
        body: dict = {
            "count": len(ids),
            "max_model_len": self.core.llm.config.max_kv_cache_capacity,
            "tokens": ids,
            "token_strs": [llm.token_piece(i) for i in ids] if req.return_token_strs else None,
        }
        return JSONResponse(body)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        self.core.check_model(req.model)
        vocab = self.core.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
        if bad is not None:
            raise bad_request(
                f"tokens.{bad}: token id {req.tokens[bad]} is not below the vocabulary size {vocab}",
                param=f"tokens.{bad}",
            )
        text = await asyncio.to_thread(self.llm.detokenize, req.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    def tokenizer_info(self) -> Response:
        """What vLLM reports: the tokenizer's configuration (special tokens, BOS handling, chat template)."""
        tokenizer = self.core.tokenizer_info
        info: dict = {
            "tokenizer_class": "PreTrainedTokenizerFast",  # a tokenizer.json, as transformers loads it
            "bos_token": None,
            "eos_token": None,
            "pad_token": None,
            "unk_token": None,
            **tokenizer.special_tokens,
            "add_bos_token": tokenizer.add_bos_token,
            "model_max_length": self.core.llm.config.max_kv_cache_capacity,
            "vocab_size": tokenizer.vocab_size,
        }
        if tokenizer.chat_template:
            info["chat_template"] = tokenizer.chat_template
        return JSONResponse(info)
