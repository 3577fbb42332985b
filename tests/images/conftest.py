"""Registers the `images` marker: tests that run the images `hack/images build` made."""


def pytest_configure(config):
    config.addinivalue_line("markers", "images: runs the container images built by hack/images build (buildah, root)")
