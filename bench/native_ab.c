/*
 * bench/native_ab.c: the native quantizers' kernels of several builds, interleaved, on one slab in memory
 * (32 x 1024 x 2048 bf16 N(0, 0.02), 128 MiB), against memcpy of the same bytes: NVFP4 (global scale
 * given), INT4 group 32 (bf16 scales), MXFP4, block-FP8, MXFP8, FP8 per-tensor (scale given), and the
 * scale groups (an expert's gate and up, 32 groups of 2 x [512, 2048]) with their scales found: FP8
 * per-tensor's and NVFP4's, by refitd_*_groups where a build has them (the pipeline: a group's amax read
 * while the one before it converts), else group by group as the daemon ran them before (the amax of a
 * group, then its members' kernels); 2 threads (rows, or groups, split in halves), then 1; the minimum of
 * 15 rounds, each running every build once, so a noisy machine's slow spells land on all of them alike.
 * NATIVE_AB_CLOCK=cpu times each thread's CPU time instead of wall time (one thread only then: a process
 * waiting for a core on a loaded machine loses wall time, not CPU time).
 * No Python, no thread pool: the C kernels alone (bench/quant.py measures the daemon's call path).
 *
 *     bash bench/native_ab.sh [REV]    # builds REV's (default HEAD~1) and the working tree's, runs both
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <pthread.h>
typedef int64_t i64;
typedef i64 (*nv_t)(const uint16_t*, i64, i64, i64, i64, uint8_t*, i64, i64, uint8_t*, i64, i64, float, i64, i64);
typedef i64 (*i4_t)(const uint16_t*, i64, i64, i64, i64, int32_t*, i64, i64, void*, i64, i64, i64, int, i64, i64);
typedef i64 (*mx_t)(const uint16_t*, i64, i64, i64, i64, uint8_t*, i64, i64, uint8_t*, i64, i64, i64, i64);
typedef i64 (*bf_t)(const uint16_t*, i64, i64, i64, i64, uint8_t*, i64, i64, float*, i64, i64, i64, i64);
typedef i64 (*pt_t)(const uint16_t*, i64, i64, i64, i64, uint8_t*, i64, i64, float, int, i64, i64);
typedef i64 (*am_t)(const uint16_t*, i64, i64, i64, i64, i64, i64);
typedef float (*sc_t)(i64);
typedef i64 (*gr_t)(const i64*, const i64*, i64, i64, float*);
struct job { int kind; int l; i64 b, e; };
static nv_t NV[8]; static i4_t I4[8]; static mx_t MX[8]; static bf_t BF[8]; static mx_t M8[8]; static pt_t PT[8];
static am_t AM[8]; static sc_t SC[8]; static gr_t PTG[8], NVG[8];
static i64 MEM[64 * 12], FIRST[33]; static float SCALES[32];
static uint8_t *Q8; static float *SF; static uint8_t *S8;
#define KINDS 9 /* memcpy, nvfp4, int4, mxfp4, block_fp8, mxfp8, fp8_per_tensor, the two formats' groups */
static const char *NAMES[KINDS] = {"memcpy", "nvfp4", "int4/g32", "mxfp4", "block_fp8", "mxfp8", "fp8_pt", "fp8_pt groups", "nvfp4 groups"};
/* groups [b, e) (32 of [1024, 2048] rows, 2 members each) of kind 7 (FP8 per-tensor) or 8 (NVFP4) */
static void run_groups(int kind, int l, i64 b, i64 e) {
  gr_t g = kind == 7 ? PTG[l] : NVG[l];
  if (g) { g(MEM, FIRST, b, e, SCALES); return; }
  for (i64 t = b; t < e; t++) { /* the old way: the group's amax, then its members */
    i64 a = 0;
    for (i64 m = FIRST[t]; m < FIRST[t + 1]; m++) { i64 r = AM[l]((const uint16_t *)MEM[m * 12], 512, 2048, 0, 2048, 0, 512); a = r > a ? r : a; }
    uint32_t ab = (uint32_t)a << 16; float amax; memcpy(&amax, &ab, 4);
    for (i64 m = FIRST[t]; m < FIRST[t + 1]; m++) {
      const i64 *f = MEM + m * 12;
      if (kind == 7) PT[l]((const uint16_t *)f[0], 512, 2048, 0, 2048, (uint8_t *)f[6], 0, 2048, SC[l](a), 1, 0, 512);
      else NV[l]((const uint16_t *)f[0], 512, 2048, 0, 2048, (uint8_t *)f[6], 0, 1024, (uint8_t *)f[9], 0, 128, a ? amax / 2688.0f : 1.0f, 0, 512);
    }
  }
}
static uint16_t *X,*Y; static uint8_t *Q,*S; static int32_t *Q4; static uint16_t *S4; static float GS; static i64 NN=1024,KK=2048; static int GG=32;
static void run_job(struct job *j){ i64 N=NN,K=KK;
  if(j->kind==0) memcpy(Y+j->b*K, X+j->b*K, (j->e-j->b)*K*2);
  else if(j->kind==1) NV[j->l](X,N,K,N*K,K,Q,N*K/2,K/2,S,N*K/16,K/16,GS,j->b,j->e);
  else if(j->kind==2) I4[j->l](X,N,K,N*K,K,Q4,N*K/8,K/8,S4,N*K/GG,K/GG,GG,0,j->b,j->e);
  else if(j->kind==3) MX[j->l](X,N,K,N*K,K,Q,N*K/2,K/2,S,N*K/32,K/32,j->b,j->e);
  /* block-FP8 units are 128-row bands: the rows' halves are whole bands here */
  else if(j->kind==4) BF[j->l](X,N,K,N*K,K,Q8,N*K,K,SF,(N/128)*(K/128),K/128,j->b/128,j->e/128);
  else if(j->kind==5) M8[j->l](X,N,K,N*K,K,Q8,N*K,K,S8,N*K/32,K/32,j->b,j->e);
  else if(j->kind==6) PT[j->l](X,N,K,N*K,K,Q8,N*K,K,GS*6.0f,0,j->b,j->e);
  else run_groups(j->kind,j->l,j->b*32/(32*N),j->e*32/(32*N));}
static void *thr(void *a){run_job(a);return 0;}
static double run2(int kind,int l,i64 units){struct job a={kind,l,0,units/2},b={kind,l,units/2,units};pthread_t t;double t0;
  extern double now(void); t0=now(); pthread_create(&t,0,thr,&b); run_job(&a); pthread_join(t,0); return now()-t0;}
static int CPU_CLOCK;
double now(void){struct timespec t;clock_gettime(CPU_CLOCK?CLOCK_THREAD_CPUTIME_ID:CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint64_t st=88172645463325252ull; static double urand(void){st^=st<<13;st^=st>>7;st^=st<<17;return (st>>11)*(1.0/9007199254740992.0);}
int main(int argc,char**argv){
  int nl=argc-1; const i64 B=32,N=1024,K=2048,tot=B*N*K; int G=32, R=15;
  CPU_CLOCK = getenv("NATIVE_AB_CLOCK") && !strcmp(getenv("NATIVE_AB_CLOCK"), "cpu");
  uint16_t*x=aligned_alloc(64,tot*2),*y=aligned_alloc(64,tot*2); uint8_t*q=aligned_alloc(64,tot/2),*s=aligned_alloc(64,tot/16);
  int32_t*q4=aligned_alloc(64,tot/2); uint16_t*s4=aligned_alloc(64,tot/G*2);
  for(i64 i=0;i<tot;i+=2){double u1=urand()+1e-300,u2=urand();double r=sqrt(-2*log(u1))*0.02;float f0=r*cos(6.283185307*u2),f1=r*sin(6.283185307*u2);
    uint32_t b0,b1;memcpy(&b0,&f0,4);memcpy(&b1,&f1,4);x[i]=(b0+0x7fff+((b0>>16)&1))>>16;x[i+1]=(b1+0x7fff+((b1>>16)&1))>>16;}
  memset(y,1,tot*2);memset(q,1,tot/2);memset(s,1,tot/16);memset(q4,1,tot/2);memset(s4,1,tot/G*2);
  uint16_t amax=0;for(i64 i=0;i<tot;i++){uint16_t a=x[i]&0x7fff;if(a>amax)amax=a;} uint32_t ab=(uint32_t)amax<<16;float af;memcpy(&af,&ab,4);float gs=af/2688.0f;
  uint8_t*q8=aligned_alloc(64,tot); float*sf=aligned_alloc(64,tot/16384*4+64); uint8_t*s8=aligned_alloc(64,tot/32);
  memset(q8,1,tot);memset(sf,1,tot/16384*4+64);memset(s8,1,tot/32);
  for(int l=0;l<nl;l++){void*h=dlopen(argv[l+1],RTLD_NOW|RTLD_LOCAL); if(!h){fprintf(stderr,"%s\n",dlerror());return 1;} NV[l]=(nv_t)dlsym(h,"refitd_nvfp4"); I4[l]=(i4_t)dlsym(h,"refitd_int4"); MX[l]=(mx_t)dlsym(h,"refitd_mxfp4");
    BF[l]=(bf_t)dlsym(h,"refitd_block_fp8"); M8[l]=(mx_t)dlsym(h,"refitd_mxfp8"); PT[l]=(pt_t)dlsym(h,"refitd_fp8_per_tensor");
    AM[l]=(am_t)dlsym(h,"refitd_amax_bits"); SC[l]=(sc_t)dlsym(h,"refitd_scale_from_amax_bits");
    PTG[l]=(gr_t)dlsym(h,"refitd_fp8_per_tensor_groups"); NVG[l]=(gr_t)dlsym(h,"refitd_nvfp4_groups");}
  X=x;Y=y;Q=q;S=s;Q4=q4;S4=s4;GS=gs;Q8=q8;SF=sf;S8=s8; (void)G;
  /* the groups: expert e's gate (rows 0..511) and up (512..1023); q8 for FP8, q / s for NVFP4 */
  for(i64 e=0;e<B;e++){ FIRST[e]=2*e; for(int h=0;h<2;h++){ i64 off=e*N*K+h*512*K, *f=MEM+(2*e+h)*12;
    i64 v[12]={(i64)(uintptr_t)(x+off),1,512,K,0,K,0,0,0,(i64)(uintptr_t)(s+off/16),0,K/16}; memcpy(f,v,sizeof v);}}
  FIRST[B]=2*B;
  double one[8][KINDS],two[8][KINDS]; for(int l=0;l<nl;l++)for(int k=0;k<KINDS;k++)one[l][k]=two[l][k]=1e9;
  for(int r=0;r<R;r++) for(int k=0;k<KINDS;k++) for(int l=0;l<(k?nl:1);l++){
    for(i64 m=0;m<2*B;m++) MEM[m*12+6]=(i64)(uintptr_t)(k==7?q8+(MEM[m*12]-(i64)(uintptr_t)x)/2:q+(MEM[m*12]-(i64)(uintptr_t)x)/4), MEM[m*12+8]=k==7?K:K/2;
    struct job j={k,l,0,B*N}; double t0=now(); run_job(&j); double t=now()-t0; if(t<one[l][k])one[l][k]=t;
    if(!CPU_CLOCK){t=run2(k,l,B*N); if(t<two[l][k])two[l][k]=t;}}
  for(int th=CPU_CLOCK?1:2;th>=1;th--){ double (*b)[KINDS]=th==2?two:one;
    printf("%d thread%s, 64M elems, min of %d: memcpy %.1f ms (%.2f GB/s of bf16 in, %.2f a thread)\n",th,th==2?"s":"",R,b[0][0]*1e3,tot*2/b[0][0]/1e9,tot*2/b[0][0]/1e9/th);
    for(int l=0;l<nl;l++){printf("  %-28s",argv[l+1]); for(int k=1;k<KINDS;k++)printf(" %s %.1f (%.0f%%)",NAMES[k],b[l][k]*1e3,100*b[0][0]/b[l][k]); printf("\n");}}
}
