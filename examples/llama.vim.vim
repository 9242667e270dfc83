" llama.vim (ggml-org/llama.vim) pointed at llmproxy.
" Start the proxy first:  make serve   (or: llmproxy serve --port 8080)
" llama.vim calls POST /infill with compact JSON; llmproxy passes the reply through byte
" for byte (llama.vim needs `"content":"` with no space) and never supersedes its
" n_predict:0 cache warm-ups.
let g:llama_config = {
    \ 'endpoint_fim': 'http://127.0.0.1:8080/infill',
    \ 'endpoint':     'http://127.0.0.1:8080/infill',
    \ 'api_key':      '',
    \ 'n_predict':    128,
    \ 'show_info':    2,
    \ }
" 'endpoint' is the option's name in llama.vim before the FIM/instruct split; newer
" versions read 'endpoint_fim'. Setting both is harmless.
" With `llmproxy serve --api-key KEY`, set 'api_key': 'KEY' (sent as Authorization: Bearer KEY).
