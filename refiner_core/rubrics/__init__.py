"""Instance rubrics: one rubric's normalisation, generation over an OpenAI-compatible API, joining."""
