# mpiexec -n 4 python examples/first_look.py     (any rank count; the README shows this file)
import numpy as np, torch, hpctp, hpctp.nn  # noqa: E401, I001  (hpctp.nn imports torch; the core does not)

grid = hpctp.ProcessGrid([0, 0])  # 2x2 on 4 ranks; 0 = let MPI choose; works on a Dup()
x = hpctp.random.normal((1000, 800), grid, split=(0, 1), seed=1)  # same values on any rank count
y = x.redistribute((None, 0))  # rows whole, columns over grid axis 0: one Alltoallv
w = hpctp.random.normal((800, 300), grid, (0, 1), seed=2)
c = x @ w  # SUMMA, pipelined Ibcast panels
k = hpctp.fft.rfftn(x)  # distributed FFT: numpy.fft.rfftn of the global tensor, in x's layout
a = x.gather(root=0)  # numpy array on rank 0, None elsewhere
x[0, :] = 1.0  # global indexing: each rank writes the part of row 0 it holds
inner = np.tanh(x[1:-1, 1:-1])  # a view per rank, no message; numpy ufuncs act on the blocks
lap = np.roll(x, 1, 0) + np.roll(x, -1, 0) - 2 * x  # numpy's periodic stencil: one row moves per neighbour
rows = hpctp.ProcessGrid([0])  # the same ranks as a 1-D grid
z = inner.redistribute((0, None), grid=rows)  # onto another grid of the same ranks: row slabs
norm = float(y.norm())  # collective: the same on every rank
if grid.rank == 0:
    print(f"grid {grid.dims}: rank 0 holds a {x.local.shape} block of {x.shape}; |y| = {norm:.6f}")

# a field as a simulation holds it: each rank's own (here: computed) block, wrapped without a copy
u = hpctp.fromfunction(lambda i, j: np.sin(i / 20) * np.cos(j / 15), (128, 96), grid, (0, 1), dtype="float32")
field = hpctp.from_local(torch.from_numpy(u.local)[None, None], grid, (None, None, 0, 1))  # [N, C, H, W]
conv = hpctp.nn.Conv2d(1, 8, 3, padding=1, grid=grid, split=(0, 1), seed=0)  # halo exchange inside
fno = hpctp.nn.SpectralConv2d(8, 8, modes=12, grid=grid, seed=0)  # Fourier layer: one spectrum-sized Allreduce
out = fno(torch.relu(conv(field)))  # DistTensors in, DistTensors out; autograd through every exchange
loss = hpctp.nn.global_mse_loss(out.local, torch.zeros_like(out.local), grid)  # the same on every rank
loss.backward()
hpctp.nn.sync_gradients(torch.nn.ModuleList([conv, fno]), grid)  # single-process gradients everywhere

gathered = [t.gather(0) for t in (w, c, k, z, u, out, lap)]  # collective: every rank calls, rank 0 gets them
if grid.rank == 0:  # the same in one process, with numpy and torch
    b, cg, kg, zg, ug, outg, lg = gathered
    rel = lambda got, want: float(np.abs(got - want).max() / np.abs(want).max())  # noqa: E731
    print(f"matmul (SUMMA)         max rel. error vs numpy: {rel(cg, a @ b):.1e}")
    print(f"rfftn                  max rel. error vs numpy: {rel(kg, np.fft.rfftn(a)):.1e}")
    a[0, :] = 1.0
    print(f"np.tanh(x[1:-1, 1:-1]) equal to numpy's: {np.array_equal(zg, np.tanh(a[1:-1, 1:-1]))}")
    lap1 = np.roll(a, 1, 0) + np.roll(a, -1, 0) - 2 * a
    print(f"np.roll stencil        equal to numpy's: {np.array_equal(lg, lap1)}")
    conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
    conv1.load_state_dict(conv.state_dict())
    want = hpctp.nn.functional.spectral_conv_fft(torch.relu(conv1(torch.from_numpy(ug)[None, None])), fno.weight)
    torch.nn.functional.mse_loss(want, torch.zeros_like(want)).backward()
    print(f"Conv2d -> FNO layer    max rel. error vs torch: {rel(outg.detach().numpy(), want.detach().numpy()):.1e}")
    print(
        f"conv weight gradient   max rel. error vs torch: {rel(conv.weight.grad.numpy(), conv1.weight.grad.numpy()):.1e}"
    )
