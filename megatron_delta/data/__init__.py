"""Data: text -> SentencePiece -> Megatron indexed dataset -> GPTDataset, and the bundled default corpus.

  text        - reading .txt / .jsonl (optionally .xz / .bz2 / .gz), sentence splitting
  tokenizers  - SentencePiece training (tools/train_tokenizer.py), Megatron-Core's tokenizer of the flags
  indexed     - preprocessing into indexed datasets (tools/preprocess_data.py), validation of a --data-path prefix
  datasets    - GPT datasets: blends, splits, the checks that name the flag
  corpus      - the bundled default corpus (the run with no data flags), built once into a cache

Megatron-Core is imported lazily, so the text helpers are cheap to import. User-facing errors are ValueError
with a message naming the flag or file and what to do.
"""
