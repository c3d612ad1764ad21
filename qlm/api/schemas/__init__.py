"""HTTP bodies, a module per API (``native``, ``openai``, ``operator``) and what they share
(``common``): what clients send (``*In``), what the API answers (``*Out``). Stored rows
(``qlm.store.RequestRow``) never leave the process as they are; ``RequestOut.of`` shapes them.

Native bodies forbid unknown fields (a typo gets a 422 naming it). OpenAI-compatible bodies ignore
the fields QLM does not use, as OpenAI-compatible servers do, but refuse the ones whose meaning it
cannot honour (``n`` > 1, ``logprobs``, ``tools``, ...), naming them. A ``response_format``
(structured output) is passed through on every endpoint.
"""
