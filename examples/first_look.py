# mpiexec -n 4 python examples/first_look.py     (any rank count; the README shows this file)
import numpy as np, torch, hpctp, hpctp.nn  # noqa: E401, I001  (hpctp.nn imports torch; the core does not)

grid = hpctp.ProcessGrid([0, 0])  # 2x2 on 4 ranks; 0 = let MPI choose
x = hpctp.random.normal((1000, 800), grid, split=(0, 1), seed=1)  # a block per rank, same values on any grid
w = hpctp.random.normal((800, 300), grid, split=(0, 1), seed=2)
c = x @ w  # SUMMA matmul
k = hpctp.fft.rfftn(x)  # numpy.fft.rfftn of the global tensor
y = x.redistribute((None, 0))  # rows whole, columns over grid axis 0: one Alltoallv
norm = float(np.linalg.norm(y))  # collective: the same on every rank

# a [N, C, H, W] field, H and W split over the grid; layers compute what torch computes on the whole field
f = lambda n, c, i, j: torch.sin(i / 20) * torch.cos(j / 15)  # noqa: E731  (each rank: its own block)
u = hpctp.fromfunction(f, (1, 1, 128, 96), grid, (None, None, 0, 1), dtype="float32", like="torch")
conv = hpctp.nn.Conv2d(1, 8, 3, padding=1, grid=grid, split=(0, 1), seed=0)  # halo exchange inside
fno = hpctp.nn.SpectralConv2d(8, 8, modes=12, grid=grid, seed=0)  # Fourier layer: the spectrum's modes split
out = fno(torch.relu(conv(u)))  # DistTensors in, DistTensors out
hpctp.nn.global_mse_loss(out.local, torch.zeros_like(out.local), grid).backward()  # through every exchange
hpctp.nn.sync_gradients(torch.nn.ModuleList([conv, fno]), grid)  # the single-process gradients everywhere

a, b, cg, kg, ug, og = [t.gather(root=0) for t in (x, w, c, k, u, out)]  # collective; rank 0 gets them
if grid.rank == 0:  # the same in one process, with numpy and torch
    rel = lambda got, want: float(abs(got - want).max() / abs(want).max())  # noqa: E731  (numpy or torch)
    print(f"grid {grid.dims}: rank 0 holds a {x.local.shape} block of {x.shape}; |y| = {norm:.6f}")
    print(f"matmul (SUMMA)         max rel. error vs numpy: {rel(cg, a @ b):.1e}")
    print(f"rfftn                  max rel. error vs numpy: {rel(kg, np.fft.rfftn(a)):.1e}")
    conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
    conv1.load_state_dict(conv.state_dict())
    want = hpctp.nn.functional.spectral_conv_fft(torch.relu(conv1(ug)), fno.weight)
    torch.nn.functional.mse_loss(want, torch.zeros_like(want)).backward()
    print(f"Conv2d -> FNO layer    max rel. error vs torch: {rel(og.detach(), want.detach()):.1e}")
    print(f"conv weight gradient   max rel. error vs torch: {rel(conv.weight.grad, conv1.weight.grad):.1e}")
