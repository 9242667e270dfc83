-- llm.nvim (huggingface/llm.nvim, which runs llm-ls) pointed at llmproxy.
-- llm-ls's "openai" backend appends /v1/completions to `url` and sends stream:false; it
-- closes the connection when Neovim cancels the request (each keystroke), and llmproxy
-- then cancels or drops that generation instead of letting it pile up.
require("llm").setup({
  backend = "openai",
  url = "http://127.0.0.1:8080",            -- requests go to http://127.0.0.1:8080/v1/completions
  model = "SmolLM2-135M-Instruct.Q4_1",     -- GET http://127.0.0.1:8080/v1/models lists the name
  api_token = nil,                          -- or the proxy's --api-key
  request_body = { max_tokens = 64, temperature = 0.2, top_p = 0.95 },
  fim = { enabled = true, prefix = "<fim_prefix>", middle = "<fim_middle>", suffix = "<fim_suffix>" },
  tokens_to_clear = { "<|endoftext|>" },
  debounce_ms = 150,
  context_window = 2048,                    -- the embedded backend's default --n-ctx
  tokenizer = nil,
  lsp = { bin_path = vim.api.nvim_call_function("stdpath", { "data" }) .. "/mason/bin/llm-ls" },
})
