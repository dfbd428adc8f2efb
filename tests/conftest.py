"""Suite-wide collection order."""


def pytest_collection_modifyitems(items):
    # The slow end-to-end tests first (stable otherwise): under `-n 2 --dist loadfile`
    # their files then run beside the rest, not alone at the end of the run.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
