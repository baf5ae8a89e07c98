# The cluster fixtures (real control plane + process kubelet) start only when a test asks for them.
pytest_plugins = ["tests.cluster.fixtures"]
