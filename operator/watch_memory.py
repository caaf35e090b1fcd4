"""What the operator has seen of each watched object, so that an event repeating it costs nothing.

kopf lists a collection again whenever it cannot resume a watch, and every object of the list
comes to the handlers once more. An object whose resourceVersion is the one last seen has not
changed (the API server gives every write a new one), so its owner needs no reconcile. A relist
does not say which objects are gone, so each relist opens an epoch of its collection, and once
its events have paused (``end_relist``) objects of older epochs count as deleted and their
owners are reconciled. Pure: no I/O, no clock; the caller times the end of a relist.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.operator.kube import Key

# A kind of object in one namespace: what one relist brings (kopf watches each namespace it
# serves apart, or all at once, which is a relist of each).
Collection = tuple[str, str]  # (plural, namespace)


@dataclass(frozen=True)
class Seen:
    owner: Key  # the InferenceService an event of the object queues
    version: str | None  # metadata.resourceVersion
    content: object  # what the owner's reconcile acts on; None: unknown, always a change
    epoch: int  # the relist of its collection it was last seen in (or after)


@dataclass(frozen=True)
class Observation:
    changed: bool  # the owner needs a reconcile
    relisting: bool  # the event belongs to a relist: its end is to be timed


class WatchMemory:
    def __init__(self) -> None:
        # Per collection: its objects by name.
        self._objects: dict[Collection, dict[str, Seen]] = {}
        self._epoch: dict[Collection, int] = {}
        self._relisting: set[Collection] = set()

    def observe(
        self,
        collection: Collection,
        name: str,
        owner: Key,
        event_type: str | None,
        version: str | None,
        content: object = None,
    ) -> Observation:
        """Remember an ADDED or MODIFIED event, or one of a listing (kopf's type None).

        content: what of the object matters to its owner's reconcile; by default its
        resourceVersion, which moves with every write."""
        if content is None:
            content = version
        objects = self._objects.setdefault(collection, {})
        before = objects.get(name)
        replayed = before is not None and version is not None and before.version == version
        relisting = event_type is None or replayed
        if relisting and collection not in self._relisting:
            self._relisting.add(collection)
            self._epoch[collection] = self._epoch.get(collection, 0) + 1
        epoch = self._epoch.get(collection, 0)
        objects[name] = Seen(owner, version, content, epoch)
        changed = before is None or content is None or before.content != content
        return Observation(changed=changed, relisting=relisting)

    def forget(self, collection: Collection, name: str) -> None:
        """A DELETED event."""
        self._objects.get(collection, {}).pop(name, None)
        self._drop_if_empty(collection)

    def end_relist(self, collection: Collection) -> set[Key]:
        """The relist of a collection is over: the owners of the objects it did not bring,
        which are forgotten. An object whose event comes after this is only reconciled once
        more, never missed; one deleted unseen is held only until here."""
        if collection not in self._relisting:
            return set()
        self._relisting.discard(collection)
        epoch = self._epoch[collection]
        objects = self._objects.get(collection, {})
        gone = {
            objects.pop(name).owner for name, seen in list(objects.items()) if seen.epoch < epoch
        }
        self._drop_if_empty(collection)
        return gone

    def _drop_if_empty(self, collection: Collection) -> None:
        # A namespace whose objects are all gone costs nothing (its epochs may start over).
        if not self._objects.get(collection) and collection not in self._relisting:
            self._objects.pop(collection, None)
            self._epoch.pop(collection, None)

    def __len__(self) -> int:
        return sum(len(objects) for objects in self._objects.values())
