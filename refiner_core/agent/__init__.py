"""The tool-calling agent: multi-turn rollouts over any rollout engine, its tools, and the Tool Call Reward."""
