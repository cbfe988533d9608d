"""The difficulty benchmark: model selection by difficulty for a virtual model, on prompts
whose difficulty the benchmark knows (``prompts``), under several routing policies
(``run``), reported with the quality-cost curve (``report``)."""
