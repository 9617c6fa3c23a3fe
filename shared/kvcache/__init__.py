BLOCK_SIZE = 16  # tokens per KV block (DESIGN.md contract)
