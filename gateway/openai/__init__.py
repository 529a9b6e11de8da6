"""The OpenAI-compatible API, in vLLM's shape: `protocol` (wire types), `serving` (logic),
`output` (events to chunks and responses), `follow` (merging job streams, disconnects),
`templates` (chat templates), `routes` (thin)."""
