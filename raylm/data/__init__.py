"""Data: from a user's files to packed blocks of token ids, and back into batches.

Runs on the driver (the tokenizer, the plan) and in Ray Data tasks (reading, rendering chats,
tokenizing, packing); ``streams`` also runs inside Ray Train workers, where it turns Ray Data's
stream into each rank's batches. Nothing here imports torch.distributed or the packages above
it (model, workers, run).
"""
