"""Training data: from text or token files to the batches of each step.

- :mod:`.builtin`: byte-level token ids and the generated built-in corpus (no files needed);
- :mod:`.tokenizer`: text to token ids (byte-level or a local Hugging Face tokenizer), documents
  and chat examples;
- :mod:`.datasets`: a dataset resolved from the config (files, format, tokenizer, cache key, split);
- :mod:`.prepare`: tokenizing a resolved dataset with a Ray Data actor pool into the cache;
- :mod:`.corpus`: batches from a prepared corpus;
- :mod:`.loader`: random windows of a token stream, and which loader a config gets.

How to join Ray before tokenizing is the caller's to pass (``connect``): data never imports the
orchestration.
"""
