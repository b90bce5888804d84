"""Samplers: ``SamplingParams``, ``SamplingMetadata``, the ``Sampler`` with its
ordered logits-processing steps, and the speculative-decoding verifiers
(rejection sampling, typical acceptance, token trees) with their drafters.
"""
