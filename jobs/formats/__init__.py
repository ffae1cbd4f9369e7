"""The wire formats batchweb reads and writes: OpenAI's batch lines, Anthropic's Message Batch
shapes, result lines, a shard's checkpoint."""
