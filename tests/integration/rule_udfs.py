"""A Python function for a rule (`--udf slug=tests.integration.rule_udfs:slug`)."""


def slug(text):
    return None if text is None else text.lower().replace(" ", "-")
