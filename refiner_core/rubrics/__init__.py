"""Instance rubrics: generation over an OpenAI-compatible API, joining per prompt (a rubric's normalisation is
data/rubric_fields.py, since row validation needs it)."""
