"""Reinforcement learning's rollouts: generator actors beside the trainers, and the rewards
of what they generate."""
