"""Host-side work on a tree that sandboxed code wrote: every walk, read and removal is bounded.

A sandbox's work dir is hostile input. The host lists it (to check an episode), measures it (the
disk watchdog), empties it (a stateless reset) and removes it (cleanup); none of these may recurse
on the tree's depth, hold memory in proportion to what a few bytes of disk can claim (sparse files,
hard links), run for a time the tree's shape decides, or raise on a shape it did not expect.

- :func:`list_tree` walks iteratively, directory by directory through file descriptors (``openat``
  with ``O_NOFOLLOW``, never a path a link could redirect), and stops with :class:`TreeLimitError`
  (a named reason) past ``max_depth`` levels, ``max_entries`` entries, ``max_read_bytes`` bytes
  read or its deadline. It reads only the files it is asked to, each at most ``read_limit`` bytes
  and each inode once (4,000 hard links to one file cost one read).
- :func:`disk_usage` sums allocated blocks (not apparent sizes) with the same bounds and stops as
  soon as the total passes the quota.
- :func:`remove_tree` removes a tree without recursion and with a bounded number of open
  descriptors: a directory deeper than a few levels is first moved up to the top (a rename in the
  same file system), so a 100,000-level chain is removed as a run of short ones. It never raises:
  what it cannot remove it reports.
- :func:`read_tar_gz` reads a gzip-compressed tar held in memory: decompressed to a cap, member
  headers read one at a time, a member's data taken from the archive's own bytes after its real
  size is checked against what is there, sparse members and links refused, members and total bytes
  capped. Nothing is extracted and no member is expanded.

Standard library only.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Literal

__all__ = [
    "TreeEntry",
    "TreeLimitError",
    "TreeLimits",
    "disk_usage",
    "list_tree",
    "read_tar_gz",
    "remove_tree",
]

#: Open flags for a directory the walk descends into: never through a link, never a device.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
#: Open flags for a file the walk reads: a fifo or a device left in the tree never blocks the host.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class TreeLimitError(Exception):
    """A tree is larger than the host agreed to look at. ``reason`` names the bound, in words
    suitable for a check's failure message ("the work dir holds more than 5,000 entries")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TreeLimits:
    """Bounds of one walk. The defaults fit a task's work dir a thousand times over."""

    max_depth: int = 32
    """Directory levels below the root."""
    max_entries: int = 5_000
    """Entries (files, directories, links, others) in the whole tree."""
    max_read_bytes: int = 8 * 2**20
    """Bytes of file contents read in total (each inode counted once)."""
    read_limit: int = 65_536
    """Bytes read of one file; a larger file is listed without its content."""
    timeout_s: float = 10.0
    """Seconds the walk may take (checked as it goes)."""

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_entries", "max_read_bytes", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"tree limit {name} must be > 0, got {getattr(self, name)}")
        if self.read_limit < 0:
            raise ValueError(f"tree limit read_limit must be >= 0, got {self.read_limit}")


@dataclass(frozen=True)
class TreeEntry:
    """One entry, as ``lstat`` saw it (links are never followed)."""

    path: str  # relative to the root, "/"-separated
    kind: Literal["file", "dir", "symlink", "other"]
    mode: int  # permission bits
    size: int  # apparent size (st_size)
    blocks: int = 0  # bytes allocated (st_blocks * 512)
    content: bytes | None = field(default=None, repr=False)
    target: str | None = None


def _kind(mode: int) -> Literal["file", "dir", "symlink", "other"]:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _plural(n: int) -> str:
    return f"{n:,}"


class _Walk:
    """The iterative walk both :func:`list_tree` and :func:`disk_usage` use: a stack of open
    directories (one per level of the current path, so at most ``max_depth + 1`` descriptors)."""

    def __init__(self, root: str | os.PathLike[str], limits: TreeLimits, what: str) -> None:
        self.limits = limits
        self.what = what
        self.deadline = time.monotonic() + limits.timeout_s
        self.count = 0
        self.root_fd = os.open(root, _DIR_FLAGS)  # here, so a missing root raises before the walk

    def __del__(self) -> None:
        if self.root_fd >= 0:  # never walked (the generator did not start): close it here
            try:
                os.close(self.root_fd)
            except OSError:
                pass

    def entries(self):
        """Yield ``(dir_fd, relative path, name, lstat result)`` for every entry, parents first."""
        limits = self.limits
        # Each level: (fd, scandir iterator, relative path of the directory, depth).
        stack: list[tuple[int, object, str, int]] = []
        try:
            stack.append((self.root_fd, os.scandir(self.root_fd), "", 0))
            while stack:
                fd, iterator, prefix, depth = stack[-1]
                try:
                    entry = next(iterator)  # type: ignore[call-overload]
                except StopIteration:
                    stack.pop()
                    iterator.close()  # type: ignore[attr-defined]
                    if fd != self.root_fd:
                        os.close(fd)
                    continue
                self.count += 1
                if self.count > limits.max_entries:
                    raise TreeLimitError(f"{self.what} holds more than {_plural(limits.max_entries)} entries")
                if self.count % 256 == 0 and time.monotonic() > self.deadline:
                    raise TreeLimitError(f"{self.what} took more than {limits.timeout_s:g} s to read")
                name = entry.name
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                rel = f"{prefix}{name}"
                yield fd, rel, name, st
                if stat.S_ISDIR(st.st_mode):
                    if depth + 1 > limits.max_depth:
                        raise TreeLimitError(f"{self.what} is nested deeper than {limits.max_depth} levels")
                    try:
                        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        continue  # unreadable (mode 000 as a normal user) or replaced: listed, not entered
                    try:
                        child_iter = os.scandir(child)
                    except OSError:
                        os.close(child)
                        continue
                    stack.append((child, child_iter, rel + "/", depth + 1))
        finally:
            _close_walk(stack, self.root_fd)
            try:
                os.close(self.root_fd)
            except OSError:
                pass
            self.root_fd = -1


def list_tree(
    root: str | os.PathLike[str],
    limits: TreeLimits = TreeLimits(),
    read: Callable[[str], bool] | None = None,
    what: str = "the work dir",
) -> list[TreeEntry]:
    """Every entry under ``root``, sorted by path, never following a link. Regular files that
    ``read(path)`` accepts (all of them when ``read`` is None) and that are at most
    ``limits.read_limit`` bytes come with their content. :class:`TreeLimitError` past a bound."""
    walk = _Walk(root, limits, what)
    entries: list[TreeEntry] = []
    contents: dict[tuple[int, int], bytes] = {}  # by inode: hard links are read once
    walked = walk.entries()
    try:
        _collect(walked, entries, contents, limits, read, what)
    finally:
        walked.close()  # its descriptors now, not when an exception's traceback lets go of it
    entries.sort(key=lambda e: e.path)
    return entries


def _collect(walked, entries: list[TreeEntry], contents: dict[tuple[int, int], bytes], limits: TreeLimits,
             read: Callable[[str], bool] | None, what: str) -> None:
    read_total = 0
    for fd, rel, name, st in walked:
        kind = _kind(st.st_mode)
        mode = st.st_mode & 0o7777
        blocks = st.st_blocks * 512
        if kind == "symlink":
            try:
                target = os.readlink(name, dir_fd=fd)
            except OSError:
                target = None
            entries.append(TreeEntry(rel, kind, mode, st.st_size, blocks, target=target))
            continue
        content = None
        if kind == "file" and st.st_size <= limits.read_limit and (read is None or read(rel)):
            key = (st.st_dev, st.st_ino)
            if key in contents:
                content = contents[key]
            else:
                if read_total + st.st_size > limits.max_read_bytes:
                    raise TreeLimitError(
                        f"{what} holds more than {limits.max_read_bytes // 2**20 or 1} MB of file contents to check")
                content = _read_file(fd, name, st, limits.read_limit)
                if content is not None:
                    read_total += len(content)
                    contents[key] = content
        entries.append(TreeEntry(rel, kind, mode, st.st_size, blocks, content=content))


def _read_file(dir_fd: int, name: str, st: os.stat_result, read_limit: int) -> bytes | None:
    """At most ``read_limit`` bytes of a regular file, or None when it is not the file ``st``
    describes any more (replaced by a link, a fifo, another file) or exceeds the limit now."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None
        chunks: list[bytes] = []
        left = read_limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 65_536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return None if len(data) > read_limit else data
    except OSError:
        return None
    finally:
        os.close(fd)


def disk_usage(
    root: str | os.PathLike[str], quota: int, limits: TreeLimits = TreeLimits(), what: str = "the work dir"
) -> int:
    """Bytes allocated under ``root`` (st_blocks, so a sparse file counts what it really holds; a
    hard-linked inode counts once). Stops early, returning a number above ``quota``, as soon as the
    total passes it; :class:`TreeLimitError` past the entry, depth or time bounds."""
    walk = _Walk(root, limits, what)
    seen: set[tuple[int, int]] = set()
    total = 0
    walked = walk.entries()
    try:
        for _, _, _, st in walked:
            if st.st_nlink > 1:
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += st.st_blocks * 512
            if total > quota:
                break
    finally:
        walked.close()
    return total


# --- removal --------------------------------------------------------------------------------------

#: Levels the removal descends before moving a deeper directory up to the top.
_REMOVE_DEPTH = 16


@dataclass
class RemoveReport:
    """What :func:`remove_tree` did: entries removed, and the first errors it could not get past."""

    removed: int = 0
    errors: list[str] = field(default_factory=list)
    complete: bool = True


def remove_tree(path: str | os.PathLike[str], keep_root: bool = False, deadline_s: float | None = None) -> RemoveReport:
    """Remove ``path`` and everything under it (``keep_root``: empty it, leave the directory),
    never following a link out of it, without recursion and with at most ``_REMOVE_DEPTH + 2``
    descriptors open. Directories a normal user cannot enter (mode 000) are opened up first. Never
    raises; ``complete`` is False when something stayed (listed in ``errors``) or the deadline
    (seconds) passed first."""
    report = RemoveReport()
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return report
    except OSError as exc:
        report.complete = False
        report.errors.append(f"{path}: {exc}")
        return report
    if not stat.S_ISDIR(st.st_mode):
        if keep_root:
            return report
        try:
            os.unlink(path)
            report.removed += 1
        except OSError as exc:
            report.complete = False
            report.errors.append(f"{path}: {exc}")
        return report
    try:
        root_fd = _open_dir(path, None)
    except OSError as exc:
        report.complete = False
        report.errors.append(f"{path}: {exc}")
        return report
    try:
        moved = 0
        # Each pass empties everything down to _REMOVE_DEPTH levels and moves deeper directories up
        # to the top, where the next pass finds them; a pass that removes nothing and moves nothing
        # means what is left cannot be removed.
        while True:
            progress, moved = _remove_pass(root_fd, report, deadline, moved)
            if deadline is not None and time.monotonic() > deadline:
                report.complete = False
                report.errors.append(f"{path}: removal ran past {deadline_s:g} s")
                return report
            with os.scandir(root_fd) as it:
                empty = next(it, None) is None
            if empty:
                break
            if not progress:
                report.complete = False
                report.errors.append(f"{path}: entries remain that cannot be removed")
                return report
    except OSError as exc:
        report.complete = False
        report.errors.append(f"{path}: {exc}")
        return report
    finally:
        os.close(root_fd)
    if not keep_root:
        try:
            os.rmdir(path)
        except OSError as exc:
            report.complete = False
            report.errors.append(f"{path}: {exc}")
    return report


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        # A directory the sandbox made unreadable (a normal user's host only; root reads it anyway):
        # give it back its owner's permissions, then enter it. O_NOFOLLOW above already refused a link.
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _remove_pass(root_fd: int, report: RemoveReport, deadline: float | None, moved: int) -> tuple[bool, int]:
    """One depth-bounded pass; (whether anything was removed or moved, the count of moves)."""
    progress = False
    # (fd, scandir iterator, depth); the directory itself is removed from its parent when popped.
    stack: list[tuple[int, object, int, str | None]] = [(root_fd, os.scandir(root_fd), 0, None)]
    steps = 0
    try:
        while stack:
            fd, iterator, depth, own_name = stack[-1]
            steps += 1
            if deadline is not None and steps % 256 == 0 and time.monotonic() > deadline:
                return progress, moved
            try:
                entry = next(iterator)  # type: ignore[call-overload]
            except StopIteration:
                stack.pop()
                iterator.close()  # type: ignore[attr-defined]
                if fd != root_fd:
                    os.close(fd)
                    parent_fd = stack[-1][0]
                    try:
                        os.rmdir(own_name, dir_fd=parent_fd)  # type: ignore[arg-type]
                        report.removed += 1
                        progress = True
                    except OSError as exc:
                        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                            _note(report, own_name, exc)
                continue
            name = entry.name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                try:
                    os.unlink(name, dir_fd=fd)
                    report.removed += 1
                    progress = True
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    _note(report, name, exc)
                continue
            if depth + 1 > _REMOVE_DEPTH:
                # Too deep to hold open: move it up to the top, where a later pass takes it.
                moved += 1
                try:
                    os.rename(name, f".tracegym-rm-{os.getpid()}-{moved}", src_dir_fd=fd, dst_dir_fd=root_fd)
                    progress = True
                except OSError as exc:
                    _note(report, name, exc)
                continue
            try:
                child = _open_dir(name, fd)
                child_iter = os.scandir(child)
            except OSError as exc:
                try:
                    os.rmdir(name, dir_fd=fd)  # an empty directory needs no entering
                    report.removed += 1
                    progress = True
                except OSError:
                    _note(report, name, exc)
                continue
            stack.append((child, child_iter, depth + 1, name))
    finally:
        _close_walk(stack, root_fd)
    return progress, moved


def _close_walk(stack: list, root_fd: int) -> None:
    """Close the directory iterators and fds of an interrupted walk (``(fd, iterator, ...)`` rows);
    ``root_fd`` stays open for its owner."""
    for fd, iterator, *_ in stack:
        try:
            iterator.close()
        except Exception:
            pass
        if fd != root_fd:
            try:
                os.close(fd)
            except OSError:
                pass


def _note(report: RemoveReport, name: str | None, exc: OSError) -> None:
    if len(report.errors) < 5:
        report.errors.append(f"{name}: {exc.strerror or exc}")


# --- archives ----------------------------------------------------------------------------------------


def read_tar_gz(
    data: bytes, max_bytes: int = 4_000_000, max_members: int = 1_000
) -> dict[str, bytes] | str:
    """``{member path: content}`` of the regular files of a gzip-compressed tar held in ``data``,
    or why it cannot be read (a sentence fragment: "holds a sparse member"). The archive is
    decompressed to at most ``max_bytes``; each member's header is read on its own and its data is
    sliced from the decompressed bytes only after its real size is checked against what is there,
    so no member can claim more than the archive holds. Sparse members (whose content a reader
    would expand from a map) are refused, as are more than ``max_members`` members. Nothing is
    written to disk."""
    if not data.startswith(b"\x1f\x8b"):
        return "is not gzip-compressed"
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        raw = inflater.decompress(data, max_bytes)
    except zlib.error as exc:
        return f"is not valid gzip ({exc})"
    if inflater.unconsumed_tail:
        return "decompresses to more than the checker reads"
    members: dict[str, bytes] = {}
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as archive:
            while True:
                member = archive.next()
                if member is None:
                    break
                count += 1
                if count > max_members:
                    return f"holds more than {max_members:,} members"
                if member.issparse():
                    return "holds a sparse member"
                if not member.isfile():
                    continue
                start, size = member.offset_data, member.size
                if size < 0 or start < 0 or start + size > len(raw):
                    return "holds a member larger than the archive"
                name = member.name
                while name.startswith("./"):
                    name = name[2:]
                members[name] = raw[start:start + size]
                # tarfile keeps every header it read; the cap above bounds that list.
    except (tarfile.TarError, OSError, EOFError, ValueError, OverflowError) as exc:
        return f"is not a valid tar archive ({type(exc).__name__})"
    return members
