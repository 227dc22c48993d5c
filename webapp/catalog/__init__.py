"""The lab's own models, registered by staff (a module file or a Hugging Face folder) for jobs to train. Never
imports jobs."""
