-- minuet-ai.nvim (milanglacier/minuet-ai.nvim) pointed at llmproxy, with its
-- openai_fim_compatible provider set up as its README does for llama.cpp: the template writes
-- the fill-in-the-middle prompt itself and sends no `suffix`; `model` is a placeholder (one
-- model is served). Requests go to POST http://127.0.0.1:8080/v1/completions, streamed (SSE).
--
-- What llmproxy does with minuet's traffic:
-- * minuet asks for `n_completions` suggestions by sending that many identical requests at
--   once. llmproxy treats them as twins: none supersedes another, each runs on a slot of its
--   own (a slot each: with fewer slots the rest queue), and the next different request of
--   the editor supersedes all of them. On a small local model, 1 is what minuet recommends.
-- * minuet kills its curl jobs when it triggers again: llmproxy sees a disconnect and stops
--   or drops that generation, so abandoned ones do not pile up.
-- * A stream llmproxy has to stop after it started (superseded, upstream failure) ends with
--   its error event and no stream terminator: curl exits 18 and minuet inserts nothing (a
--   stream that ended cleanly it would insert, cut). Its `request_timeout` (curl --max-time,
--   exit 28) still keeps what arrived, as minuet intends.
require('minuet').setup {
    provider = 'openai_fim_compatible',
    n_completions = 1, -- identical requests per trigger; each takes a slot (see above)
    context_window = 2048, -- characters; the embedded backend's default --n-ctx is 2048 tokens
    throttle = 1000, -- minuet's defaults: at most a request a second,
    debounce = 400, -- after 400 ms without a keystroke
    request_timeout = 3,
    provider_options = {
        openai_fim_compatible = {
            api_key = 'TERM', -- an environment variable minuet reads; or one holding --api-key
            name = 'llmproxy',
            end_point = "http://127.0.0.1:8080/v1/completions",
            model = 'PLACEHOLDER', -- any name: GET http://127.0.0.1:8080/v1/models lists the real one
            stream = true,
            optional = {
                max_tokens = 56,
                top_p = 0.9,
            },
            -- llama.cpp-style: the prompt carries the model's FIM tokens (here SmolLM2's and
            -- StarCoder's; Qwen2.5-Coder uses <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)
            template = {
                prompt = function(context_before_cursor, context_after_cursor, _)
                    return '<fim_prefix>'
                        .. context_before_cursor
                        .. '<fim_suffix>'
                        .. context_after_cursor
                        .. '<fim_middle>'
                end,
                suffix = false,
            },
        },
    },
    virtualtext = {
        auto_trigger_ft = { '*' },
        keymap = { accept = '<A-A>', accept_line = '<A-a>', next = '<A-]>', prev = '<A-[>' },
    },
}

-- An OpenAI-FIM-style server that takes `suffix` itself (Ollama's /v1/completions, for one)
-- keeps minuet's default template instead: drop `template` above and name the real model.
