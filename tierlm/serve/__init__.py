"""The inference recipes: `tierlm generate`, `tierlm chat` and `tierlm serve` (the OpenAI-compatible
HTTP server), their typed options and the generation report. They read the settings and the cached
rates and hand them to tierlm.infer, which executes."""
