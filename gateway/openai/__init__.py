"""The OpenAI-compatible API, in vLLM's shape: `protocol` (wire types), `serving` (logic),
`output` (events → chunks and responses), `templates` (chat templates), `routes` (thin)."""
