"""Removing, or clearing of setuid and setgid bits, a folder that a session's commands wrote.

Whatever the commands made of it is walked without being trusted: depth first without recursion
(a tree of any depth; shutil.rmtree and os.fwalk recurse, and 3,000 nested folders made them
raise RecursionError), by descriptor (a path longer than PATH_MAX is walked all the same, and no
path name is resolved again, so no symlink swapped in is followed), never onto another filesystem
or into a mount point a command made inside (a bind mount of a host folder: its files are not the
session's). One descriptor of the tree is open at a time; going back up reopens ".." and checks
that it is the folder that was left. A folder closed to its owner (mode 000) is opened to it
(u+rwx) first, through an O_PATH descriptor, so no name is followed there either.

Called once the session's processes are gone, by the runner's user: what it cannot remove (an
immutable file, a mount point and the folders above it) is left, and the walk says so (False).
"""

from __future__ import annotations

import os
import stat

_SET_ID = stat.S_ISUID | stat.S_ISGID
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HANDLE = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(top: str) -> bool:
    """Remove `top`, whatever it is now: a symlink, a file or a fifo where a folder was is
    unlinked, never followed. True when nothing of it is left."""
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            os.unlink(top)
            return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return _walk(top, _unlink, _rmdir)


def clear_set_id_bits(top: str) -> bool:
    """Clear the setuid and setgid bits of `top` and of every file and folder under it. True when
    every folder was reached."""
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            return True
    except OSError:
        return True
    return _walk(top, _clear_file, None)


def _walk(top: str, on_entry, on_folder_done) -> bool:
    """Walk the folder `top`: each folder is opened to its owner and cleared of setuid and setgid
    bits when entered, `on_entry(fd, name)` is called for every entry that is not a folder, and
    `on_folder_done(parent_fd, name)` once a folder's content was walked (bottom-up)."""
    top = os.path.realpath(top)  # as the mount table names folders
    mounts = _mount_points_under(top)
    if top in mounts:  # a command mounted a host folder on its own working folder
        return False
    try:
        base_fd = os.open(os.path.dirname(top), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    complete = True
    fd = None
    try:
        device = os.lstat(top).st_dev
        fd = _enter(base_fd, os.path.basename(top), device)
        if fd is None:
            return False
        path = [os.path.basename(top)]  # the names from top down to the folder fd is
        above: list[tuple[tuple[int, int], list[str]]] = []  # per folder above: its identity, subfolders left
        pending, complete = _walk_content(fd, on_entry)
        while True:
            if pending:
                name = pending.pop()
                mounted = mounts and os.path.join(os.path.dirname(top), *path, name) in mounts
                child = None if mounted else _enter(fd, name, device)
                if child is None:
                    complete = False
                    continue
                info = os.fstat(fd)
                above.append(((info.st_dev, info.st_ino), pending))
                os.close(fd)
                fd = child
                pending, listed = _walk_content(fd, on_entry)
                complete &= listed
                path.append(name)
                continue
            name = path.pop()
            if not above:  # top itself
                os.close(fd)
                fd = None
                return bool(on_folder_done is None or on_folder_done(base_fd, name)) and complete
            identity, pending = above.pop()
            parent = _parent(fd, identity)
            os.close(fd)
            fd = parent
            if fd is None:  # moved meanwhile: nothing more of the tree is walked
                return False
            if on_folder_done is not None:
                complete &= on_folder_done(fd, name)
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
        os.close(base_fd)


def _walk_content(fd: int, on_entry) -> tuple[list[str], bool]:
    """Call on_entry for the folder's entries that are not folders; its subfolders' names, and
    whether every entry could be listed."""
    folders: list[str] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.name)
                else:
                    on_entry(fd, entry.name)
    except OSError:
        return folders, False
    return folders, True


def _enter(parent_fd: int, name: str, device: int) -> int | None:
    """A descriptor of the folder `name` of `parent_fd`, opened to its owner (u+rwx) and cleared of
    setuid and setgid bits; None for a symlink, a folder of another filesystem, or one that
    cannot be opened."""
    try:
        handle = os.open(name, _HANDLE | os.O_DIRECTORY, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        info = os.fstat(handle)
        if info.st_dev != device:
            return None
        mode = stat.S_IMODE(info.st_mode)
        wanted = mode & ~_SET_ID
        if info.st_uid == os.geteuid():
            wanted |= stat.S_IRWXU
        if wanted != mode:
            os.chmod(f"/proc/self/fd/{handle}", wanted)  # the folder the handle holds, not a name
        return os.open(".", _FOLDER, dir_fd=handle)
    except OSError:
        return None
    finally:
        os.close(handle)


def _parent(fd: int, identity: tuple[int, int]) -> int | None:
    try:
        parent = os.open("..", _FOLDER, dir_fd=fd)
    except OSError:
        return None
    info = os.fstat(parent)
    if (info.st_dev, info.st_ino) != identity:
        os.close(parent)
        return None
    return parent


def _unlink(fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except OSError:
        pass  # the folder's rmdir then fails: reported by the walk


def _rmdir(parent_fd: int, name: str) -> bool:
    try:
        os.rmdir(name, dir_fd=parent_fd)
        return True
    except OSError:
        return False


def _clear_file(fd: int, name: str) -> None:
    """Clear the setuid and setgid bits of a regular file: through an O_PATH descriptor of the
    entry itself, so a symlink is never followed."""
    try:
        handle = os.open(name, _HANDLE, dir_fd=fd)
    except OSError:
        return
    try:
        info = os.fstat(handle)
        if stat.S_ISREG(info.st_mode) and info.st_mode & _SET_ID:
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IMODE(info.st_mode) & ~_SET_ID)
    except OSError:
        pass
    finally:
        os.close(handle)


def _mount_points_under(top: str) -> set[str]:
    """The mount points of this process's namespace at or inside `top` (a command's bind mount
    of a host folder there has the same device number as the tree: only the mount table tells)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read().decode(errors="surrogateescape")
    except OSError:
        return set()
    points = {_unescape(line.split(" ")[4]) for line in table.splitlines() if line.count(" ") >= 4}
    return {point for point in points if point == top or point.startswith(top + "/")}


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in octal (\040, \011, \012, \134).
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
