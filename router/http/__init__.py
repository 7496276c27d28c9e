"""The router's OpenAI-compatible HTTP door (``headrace router --http-port``): `app` (routes),
`requests` and `prompts` (OpenAI bodies in), `responses` (OpenAI bodies out), `call` (one
call through a `RouterSession`, SSE), `errors` (OpenAI-shaped errors), `auth`, `models`,
`server` (uvicorn on the router's loop)."""
