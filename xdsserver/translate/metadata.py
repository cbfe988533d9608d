"""Where the request's model travels as Envoy metadata: json_to_metadata writes the body's
``model`` to ``envoy.lb`` (design.md), the router merges that namespace into a route's
metadata match, and subset load balancing and tracing read it from there."""

MODEL_METADATA_NAMESPACE = "envoy.lb"
"""Where json_to_metadata puts the body's ``model`` field (design.md: namespace envoy.lb)."""
MODEL_METADATA_KEY = "model"
"""The key of the model: in the request's metadata, and in the endpoints' (the models each
serves, for subset load balancing)."""
