"""The trainer's building blocks for synchronous GRPO.

grpo (advantages, clipped loss, entropy: pure torch) <- policy (the engine's Transformer over Parameters);
rewards (math answers, plugins); data (problems, prompt sampler, dataset tokenizer); checkpoint (atomic saves).
"""
